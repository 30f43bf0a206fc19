"""The memory tier in front of the storage paths: one index over both, reads from the fastest copy,
write policies, flushes, promotion on the second hit, demotion, recovery of both copies."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from conftest import BLOCK_TOKENS, UNIT_TOKENS, assert_units_equal, make_kv, open_store, snapshot, zero
from tutti_cluster import TuttiConfig, TuttiStore
from tutti_cluster.errors import ConfigError

MEM_GB = 0.0005  # 7 GPU files of the test model


def tiered(store_dirs: list[Path], mem_dir: Path, kv: list, **kw):
    return open_store(store_dirs, kv, memory_paths=[mem_dir], memory_capacity_gb=MEM_GB, **kw)


def test_stores_land_in_memory_and_reach_storage(store_dirs, mem_dir):
    kv = make_kv(seed=3)
    with tiered(store_dirs, mem_dir, kv) as s:
        st = s.stats()
        assert st["memory_slots"] == 7 and st["memory_free_slots"] == 7
        ub = s.unit_blocks
        keys = list(range(1, 6))
        blocks = np.arange(5 * ub)
        assert s.store(keys, blocks).ok
        assert set(s.unit_tiers(keys)) <= {"memory", "both"}
        assert s.flush(timeout_s=30)
        assert s.unit_tiers(keys) == ["both"] * 5
        st = s.stats()
        assert st["flushes"] == 5 and st["flush_backlog"] == 0 and st["memory_units"] == 5
        assert st["flush_bytes"] == 5 * st["slot_bytes"]
        want = snapshot(kv)
        zero(kv)
        assert s.lookup(keys) == 5
        res = s.retrieve(keys, blocks)
        assert res.ok, res
        assert_units_equal(want, blocks, kv, blocks, "kv_first", list(range(5)), ub)
        st = s.stats()
        assert st["memory_hits"] == 5 and st["storage_hits"] == 0
        assert st["memory_bytes_read"] == st["bytes_read"] > 0


def test_one_request_mixes_tiers_and_restart_keeps_both_copies(store_dirs, mem_dir):
    """More units than the memory tier holds: the rest land on storage (the memory tier is full of
    units not yet flushed), one retrieve reads from both, and a restart finds every copy again."""
    kv = make_kv(seed=4)
    with tiered(store_dirs, mem_dir, kv) as s:
        ub = s.unit_blocks
        keys = list(range(100, 112))
        blocks = np.arange(12 * ub)
        assert s.store(keys, blocks).committed_units == list(range(12))
        tiers = s.unit_tiers(keys)
        assert tiers.count("storage") == 5 and tiers.count("memory") + tiers.count("both") == 7
        s.flush(timeout_s=30)
        want = snapshot(kv)
    zero(kv)
    with tiered(store_dirs, mem_dir, kv) as s:
        assert s.unit_tiers(keys) == ["storage" if t == "storage" else "both" for t in tiers]
        res = s.retrieve(keys, blocks)
        assert res.ok, res
        assert_units_equal(want, blocks, kv, blocks, "kv_first", list(range(12)), ub)
        st = s.stats()
        assert 0 < st["memory_bytes_read"] < st["bytes_read"]


def test_unflushed_units_are_flushed_after_a_restart(store_dirs, mem_dir):
    """A unit in memory only when the process stops (a close before its flush, or a crash) is
    found in the memory tier at the next open and copied to storage then."""
    kv = make_kv(seed=5)
    with tiered(store_dirs, mem_dir, kv, write_policy="memory_only") as s:
        keys = [7, 8, 9]
        assert s.store(keys, np.arange(3 * s.unit_blocks)).ok
        assert s.unit_tiers(keys) == ["memory"] * 3
    with tiered(store_dirs, mem_dir, kv) as s:
        assert s.flush(timeout_s=30)
        assert s.unit_tiers(keys) == ["both"] * 3


def test_write_through_returns_with_the_storage_copy(store_dirs, mem_dir):
    kv = make_kv(seed=6)
    with tiered(store_dirs, mem_dir, kv, write_policy="write_through") as s:
        keys = [1, 2, 3]
        assert s.store(keys, np.arange(3 * s.unit_blocks)).ok
        assert s.unit_tiers(keys) == ["both"] * 3  # at once, no flush() needed


def test_memory_only_never_writes_storage_and_evicts_from_memory(store_dirs, mem_dir):
    kv = make_kv(seed=7)
    with tiered(store_dirs, mem_dir, kv, write_policy="memory_only") as s:
        ub = s.unit_blocks
        for batch in range(3):  # 15 units through 7 memory slots
            keys = list(range(batch * 5, batch * 5 + 5))
            assert s.store(keys, np.arange(5 * ub)).ok
        st = s.stats()
        assert st["flushes"] == 0 and st["units"] == 7 and st["memory_units"] == 7
        assert st["evictions"] == 8
        assert s.unit_tiers(list(range(8, 15))) == ["memory"] * 7


def test_promotion_on_the_second_hit_and_demotion_of_flushed_units(store_dirs, mem_dir):
    """A unit read from storage is promoted on its second hit (promote_hits=2), not the first; room
    is made by demoting the least recently used unit that has a storage copy."""
    kv = make_kv(seed=8)
    with tiered(store_dirs, mem_dir, kv) as s:
        ub = s.unit_blocks
        hot = list(range(1, 8))
        assert s.store(hot, np.arange(7 * ub)).ok  # fills memory
        s.flush(timeout_s=30)
        cold = list(range(50, 53))
        assert s.store(cold, np.arange(3 * ub)).ok  # demotes three of `hot`
        s.flush(timeout_s=30)
        assert s.stats()["demotions"] == 3
        storage_only = [k for k, t in zip(hot, s.unit_tiers(hot)) if t == "storage"]
        assert storage_only == hot[:3]  # the least recently used
        blocks = np.arange(ub)
        want = snapshot(kv)
        k = storage_only[0]
        assert s.retrieve([k], blocks).ok
        s.flush(timeout_s=30)
        assert s.unit_tiers([k]) == ["storage"] and s.stats()["promotions"] == 0
        zero(kv)
        assert s.retrieve([k], blocks).ok  # second hit: read from storage, then promoted
        assert_units_equal(want, blocks, kv, blocks, "kv_first", [0], ub)
        assert s.flush(timeout_s=30)
        assert s.unit_tiers([k]) == ["both"] and s.stats()["promotions"] == 1
        zero(kv)
        before = s.stats()["memory_bytes_read"]
        assert s.retrieve([k], blocks).ok  # now from memory
        assert s.stats()["memory_bytes_read"] > before
        assert_units_equal(want, blocks, kv, blocks, "kv_first", [0], ub)


def test_pin_into_memory_copies_and_keeps_the_unit_there(store_dirs, mem_dir):
    """pin(memory=True) copies a unit on storage only into memory at once (no hits needed), and its
    memory copy outlives later stores that demote every unpinned unit; unpinned, it is demoted."""
    kv = make_kv(seed=10)
    with tiered(store_dirs, mem_dir, kv, promote_hits=0) as s:
        ub = s.unit_blocks
        first = list(range(1, 8))
        assert s.store(first, np.arange(7 * ub)).ok
        s.flush(timeout_s=30)
        assert s.store(list(range(20, 27)), np.arange(7 * ub)).ok  # demotes every one of `first`
        s.flush(timeout_s=30)
        assert s.unit_tiers(first) == ["storage"] * 7
        assert s.pin(first[:2], memory=True) == 2
        assert s.pin(first[:2], memory=True) == 0  # queued or done already: not twice
        assert s.flush(timeout_s=30)
        assert s.unit_tiers(first[:2]) == ["both"] * 2 and s.stats()["promotions"] == 2
        assert s.store(list(range(40, 47)), np.arange(7 * ub)).ok  # memory pressure again
        s.flush(timeout_s=30)
        assert s.unit_tiers(first[:2]) == ["both"] * 2
        s.unpin(first[:2])
        s.unpin(first[:2])
        assert s.store(list(range(60, 67)), np.arange(7 * ub)).ok
        s.flush(timeout_s=30)
        assert s.unit_tiers(first[:2]) == ["storage"] * 2
        assert s.pin([999], memory=True) == 0  # absent: nothing to copy


def test_pin_into_memory_without_a_memory_tier_copies_nothing(store_dirs):
    with open_store(store_dirs, make_kv(seed=11)) as s:
        assert s.store([3], np.arange(s.unit_blocks)).ok
        assert s.pin([3], memory=True) == 0
        assert s.stats()["pinned"] == 1


def test_remove_drops_both_copies(store_dirs, mem_dir):
    kv = make_kv(seed=9)
    with tiered(store_dirs, mem_dir, kv, write_policy="write_through") as s:
        assert s.store([5], np.arange(s.unit_blocks)).ok
        assert s.unit_tiers([5]) == ["both"]
        assert s.remove(5)
    with tiered(store_dirs, mem_dir, kv) as s:
        assert s.lookup([5]) == 0 and s.stats()["units"] == 0


def test_memory_tier_on_hugetlbfs(store_dirs, hugetlbfs):
    """hugetlbfs takes no write(2): every copy in and out of its files goes through their mapping.
    Stores land there, flush, serve retrieves, come back after a restart (and in a read-only
    open), and a unit is promoted into it."""
    kv = make_kv(seed=12)
    with tiered(store_dirs, hugetlbfs, kv, promote_hits=0) as s:
        ub = s.unit_blocks
        keys = list(range(1, 10))
        blocks = np.arange(9 * ub)
        assert s.store(keys, blocks).committed_units == list(range(9))
        assert s.flush(timeout_s=30)
        tiers = s.unit_tiers(keys)
        assert tiers.count("both") == 7 and tiers.count("storage") == 2
        want = snapshot(kv)
        zero(kv)
        res = s.retrieve(keys, blocks)
        assert res.ok, res
        assert_units_equal(want, blocks, kv, blocks, "kv_first", list(range(9)), ub)
        st = s.stats()
        assert st["memory_bytes_read"] * 9 == st["bytes_read"] * 7 > 0
        in_memory = bytes(s.read_unit(keys[0]))
    zero(kv)
    with tiered(store_dirs, hugetlbfs, kv, promote_hits=0) as s:
        assert s.unit_tiers(keys) == tiers
        assert s.remove(keys[0])  # room in memory for a promotion
        moved = keys[tiers.index("storage")]
        assert s.pin([moved], memory=True) == 1 and s.flush(timeout_s=30)
        assert s.unit_tiers([moved]) == ["both"]
        res = s.retrieve(keys[1:], blocks[ub:])
        assert res.ok, res
        assert_units_equal(want, blocks[ub:], kv, blocks[ub:], "kv_first", list(range(8)), ub)
    reader = TuttiStore(TuttiConfig(paths=store_dirs, capacity_gb=0.02, unit_tokens=UNIT_TOKENS,
                                    memory_paths=[hugetlbfs], memory_capacity_gb=MEM_GB))
    reader.register_kv_caches(kv, block_tokens=BLOCK_TOKENS, layout="kv_first", read_only=True)
    with reader:
        assert reader.lookup([moved]) == 1
        assert len(in_memory) == reader.stats()["slot_bytes"]
        assert bytes(reader.read_unit(keys[1])) != in_memory  # another unit, read through the mapping


def test_memory_tier_must_be_a_memory_file_system(store_dirs, tmp_path):
    d = tmp_path / "not-tmpfs"
    d.mkdir()
    if os.path.isdir("/dev/shm") and os.stat(d).st_dev == os.stat("/dev/shm").st_dev:
        pytest.skip("the temporary directory is itself on tmpfs")
    with pytest.raises(ConfigError, match="memory file system"):
        open_store(store_dirs, make_kv(), memory_paths=[d], memory_capacity_gb=MEM_GB)

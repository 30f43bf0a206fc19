"""Adversarial tests of the memory tier (issue 46): kill -9 while units are flushed, promoted and
demoted; a damaged copy in one tier; a model-checked state machine over every write policy; and the
integrity tests of issue 13 re-run with a memory tier in front of the storage paths.

The memory tier lives on /dev/shm (tmpfs), as a deployment's does; pool files are found by scanning
for the header magic (test_integrity.find_slots), never by guessing offsets. This file is also the
writer process of the crash test (``python test_tiers_attack.py writer ...``)."""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from conftest import make_kv, open_store, run_threads, shm_dir, zero
from crash_writer import unit_data

HERE = Path(__file__).parent
POLICIES = ["write_back", "write_through", "memory_only"]


# ---- helpers ------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def slot_bytes() -> int:
    d = Path(tempfile.mkdtemp(prefix="tutti-probe-"))
    try:
        with open_store([d], make_kv()) as s:
            return s.geometry()["slot_bytes"]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def gb(slots: int) -> float:
    """A capacity in GiB that holds `slots` GPU files of the test model (and not one more)."""
    return (slots + 0.5) * slot_bytes() / (1 << 30)


def tiered(storage: Path, mem: Path, kv: list, *, storage_slots: int, memory_slots: int, **kw):
    return open_store([storage], kv, capacity_gb=gb(storage_slots), memory_paths=[mem],
                      memory_capacity_gb=gb(memory_slots), **kw)


def fill(kv: list, unit: int, ub: int, seed: int) -> None:
    """Unit `unit` of the KV blocks gets the bytes of `seed` (crash_writer.unit_data)."""
    for l in range(len(kv)):
        kv[l][:, unit * ub:(unit + 1) * ub] = unit_data(seed, kv[l].shape, ub, l)


def holds(kv: list, unit: int, ub: int, seed: int) -> bool:
    return all(np.array_equal(kv[l][:, unit * ub:(unit + 1) * ub], unit_data(seed, kv[l].shape, ub, l))
               for l in range(len(kv)))


def slots_in_use(s) -> tuple[int, int]:
    """(storage, memory) slots the index says are used: one per copy."""
    tiers = s.unit_tiers(s.keys())
    return (sum(t in ("storage", "both") for t in tiers), sum(t in ("memory", "both") for t in tiers))


def check_accounting(s) -> None:
    """Quiescent store: the slot counters agree with where the index says every unit lies."""
    st_ = s.stats()
    in_storage, in_memory = slots_in_use(s)
    assert st_["units"] == len(s.keys())
    assert st_["memory_units"] == in_memory, (st_["memory_units"], in_memory)
    assert in_memory <= st_["memory_slots"]
    assert in_storage <= st_["total_slots"] - st_["memory_slots"]
    assert st_["memory_slots"] - st_["memory_free_slots"] == in_memory, "memory slots leaked or double-used"
    storage_free = st_["free_slots"] - st_["memory_free_slots"]
    assert st_["total_slots"] - st_["memory_slots"] - storage_free == in_storage, "storage slots leaked or double-used"


# ---- 1. kill -9 while flushing, promoting and demoting -------------------------------------------
CRASH_STORAGE_SLOTS, CRASH_MEMORY_SLOTS = 24, 4


def _writer(storage: str, mem: str, start: int, seed: int) -> None:
    """Stores batches of 4 units (bytes from their keys) into a write_back memory tier of 4 slots
    in front of 24 storage slots, reads 3 known units twice each (the second hit promotes),
    sometimes removes one, and prints each batch's first key; forever."""
    kv = make_kv(seed=0)
    s = tiered(Path(storage), Path(mem), kv, storage_slots=CRASH_STORAGE_SLOTS, memory_slots=CRASH_MEMORY_SLOTS,
               write_policy="write_back", promote_hits=2)
    ub = s.unit_blocks
    rng = np.random.default_rng(seed)
    known = s.keys()  # earlier rounds' units: storage copies to promote at once
    key = start
    while True:
        keys = list(range(key, key + 4))
        for u, k in enumerate(keys):
            fill(kv, u, ub, k)
        res = s.store(keys, np.arange(4 * ub))
        assert all(f.cause == "no_free_slot" for f in res.failures), res
        known += [keys[u] for u in res.committed_units]
        for k in rng.choice(known, size=min(3, len(known)), replace=False):
            for _ in range(2):
                zero(kv)
                got = s.retrieve([int(k)], np.arange(ub))
                if got.ok:
                    assert holds(kv, 0, ub, int(k)), f"unit {k} read back wrong"
                else:  # evicted meanwhile; never a damaged copy
                    assert [f.cause for f in got.failures] == ["not_present"], got
        if rng.random() < 0.2:
            s.remove(int(rng.choice(known)))
        print(key, flush=True)
        key += 4


def test_kill_9_while_flushing_promoting_and_demoting_leaves_only_exact_units(tmp_path, mem_dir):
    """SIGKILL a write_back writer at random moments, while its flusher copies units to storage,
    promotions copy storage units into memory and stores demote flushed ones. After each kill every
    unit the store finds is byte-exact in some tier, the slot counts add up, and units left in
    memory only reach storage again (flush)."""
    storage = tmp_path / "ssd"
    storage.mkdir()
    rng = np.random.default_rng(46)
    start, seen = 1, set()
    for round_ in range(6):
        p = subprocess.Popen([sys.executable, str(HERE / "test_tiers_attack.py"), "writer", str(storage), str(mem_dir),
                              str(start), str(round_)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=HERE)
        for _ in range(1 + round_ % 3):
            assert p.stdout.readline(), f"writer died: {p.stderr.read()}"
        time.sleep(float(rng.uniform(0, 0.03)))
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait() == -signal.SIGKILL, p.stderr.read()
        start += 10_000
        kv = make_kv(seed=1)
        with tiered(storage, mem_dir, kv, storage_slots=CRASH_STORAGE_SLOTS, memory_slots=CRASH_MEMORY_SLOTS,
                    promote_hits=0) as s:
            ub = s.unit_blocks
            keys = s.keys()
            assert keys, "nothing survived"
            assert all(k < start for k in keys), keys  # only keys the writers stored
            tiers = s.unit_tiers(keys)  # the flusher is at work already: "memory" may read "both"
            assert "" not in tiers
            evicted: list[int] = []  # by the flushes of units recovered in memory only (storage full)
            s.on_evict = evicted.append
            for k, t in zip(keys, tiers):
                zero(kv)
                res = s.retrieve([k], np.arange(ub))
                if not res.ok and [f.cause for f in res.failures] == ["not_present"] and k in evicted:
                    continue
                assert res.ok, f"round {round_}: unit {k} ({t}) listed but not intact: {res}"
                assert holds(kv, 0, ub, k), f"round {round_}: unit {k} ({t}) is not what was stored under its key"
            assert s.flush(timeout_s=30)
            keys = s.keys()
            after = s.unit_tiers(keys)
            assert set(after) <= {"both", "storage"}, dict(zip(keys, after))
            check_accounting(s)
            assert s.stats()["flush_backlog"] == 0
            seen.update(tiers)
    assert "memory" in seen or "both" in seen, seen


# ---- 2. a damaged copy in one tier ---------------------------------------------------------------
def _damage(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _object_at(g: dict, layer: int, obj: int) -> int:
    return g["header_bytes"] + (layer * g["objs_per_layer"] + obj) * g["obj_bytes"] + 123


def test_a_damaged_memory_copy_is_a_miss_there_and_the_storage_copy_serves(store_dirs, mem_dir):
    from test_integrity import find_slots

    kv = make_kv(seed=11)
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=4) as s:
        ub, g = s.unit_blocks, s.geometry()
        keys = [1, 2, 3]
        for u, k in enumerate(keys):
            fill(kv, u, ub, k)
        assert s.store(keys, np.arange(3 * ub)).ok
        assert s.flush(timeout_s=30) and s.unit_tiers(keys) == ["both"] * 3
        f, off = find_slots([mem_dir])[2]
        _damage(f, off + _object_at(g, 2, 1))
        zero(kv)
        res = s.retrieve(keys, np.arange(3 * ub))
        assert res.failed_units == [1] and res.failures[0].cause == "checksum", res
        assert res.failures[0].pool_file == str(f), res
        assert holds(kv, 0, ub, 1) and holds(kv, 2, ub, 3)
        assert s.unit_tiers(keys) == ["both", "storage", "both"]
        assert s.lookup([2]) == 1
        zero(kv)
        res = s.retrieve([2], np.arange(ub))
        assert res.ok, res
        assert holds(kv, 0, ub, 2)
        assert s.stats()["checksum_failures"] == 1
        check_accounting(s)
    assert 2 not in find_slots([mem_dir]), "the damaged memory copy still carries its header"
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=4) as s:
        assert s.unit_tiers(keys) == ["both", "storage", "both"]
        check_accounting(s)


def test_a_damaged_memory_copy_is_never_flushed(store_dirs, mem_dir):
    """Units in memory only when the store closed; one is damaged meanwhile. At the next open the
    flusher verifies before it copies: the damaged unit is dropped (a miss), never written to storage."""
    from test_integrity import find_slots

    kv = make_kv(seed=12)
    keys = [4, 5, 6]
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=4, write_policy="memory_only") as s:
        ub, g = s.unit_blocks, s.geometry()
        for u, k in enumerate(keys):
            fill(kv, u, ub, k)
        assert s.store(keys, np.arange(3 * ub)).ok
    f, off = find_slots([mem_dir])[5]
    _damage(f, off + _object_at(g, 0, 0))
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=4) as s:
        assert s.flush(timeout_s=30)
        assert s.unit_tiers(keys) == ["both", "", "both"]
        st_ = s.stats()
        assert st_["checksum_failures"] == 1 and st_["flush_errors"] == 1 and st_["flushes"] == 2, st_
        check_accounting(s)
        zero(kv)
        res = s.retrieve([4, 6], np.arange(2 * ub))
        assert res.ok and holds(kv, 0, ub, 4) and holds(kv, 1, ub, 6)
    assert 5 not in find_slots(store_dirs) and 5 not in find_slots([mem_dir])


def test_a_damaged_storage_copy_is_not_promoted(store_dirs, mem_dir):
    """Units on storage only (stored before the memory tier existed); one is damaged on disk. Its
    first hit (promote_hits=1) fails the checksum and drops it; it is never copied into memory,
    while the healthy unit is promoted."""
    from test_integrity import find_slots

    kv = make_kv(seed=13)
    with open_store([store_dirs[0]], kv, capacity_gb=gb(8)) as s:
        ub, g = s.unit_blocks, s.geometry()
        for u, k in enumerate([7, 8]):
            fill(kv, u, ub, k)
        assert s.store([7, 8], np.arange(2 * ub)).ok
    f, off = find_slots(store_dirs)[7]
    _damage(f, off + _object_at(g, 3, 1))
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=4, promote_hits=1) as s:
        assert s.unit_tiers([7, 8]) == ["storage", "storage"]
        zero(kv)
        res = s.retrieve([7], np.arange(ub))
        assert res.failed_units == [0] and res.failures[0].cause == "checksum", res
        res = s.retrieve([8], np.arange(ub))
        assert res.ok and holds(kv, 0, ub, 8)
        assert s.flush(timeout_s=30)
        assert s.unit_tiers([7, 8]) == ["", "both"]
        assert s.stats()["promotions"] == 1
        check_accounting(s)
    assert 7 not in find_slots([mem_dir]) and 7 not in find_slots(store_dirs)
    assert 8 in find_slots([mem_dir])


def test_a_damaged_memory_header_leaves_the_storage_copy(store_dirs, mem_dir):
    """A memory copy whose header no longer verifies (on disk, store closed) is free space at the
    next open; the unit is served from its storage copy and the slot is reusable."""
    from test_integrity import find_slots

    kv = make_kv(seed=14)
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=2, write_policy="write_through") as s:
        ub = s.unit_blocks
        fill(kv, 0, ub, 9)
        fill(kv, 1, ub, 10)
        assert s.store([9, 10], np.arange(2 * ub)).ok
        assert s.unit_tiers([9, 10]) == ["both", "both"]
    f, off = find_slots([mem_dir])[9]
    _damage(f, off + 40)
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=2) as s:
        assert s.unit_tiers([9, 10]) == ["storage", "both"]
        assert s.stats()["bad_headers"] == 1 and s.stats()["memory_free_slots"] == 1
        check_accounting(s)
        zero(kv)
        assert s.retrieve([9], np.arange(ub)).ok and holds(kv, 0, ub, 9)


def test_a_lost_memory_tier_keeps_every_unit_that_reached_storage(store_dirs, mem_dir):
    """A host restart empties tmpfs: the units with a storage copy are all there, exact."""
    kv = make_kv(seed=15)
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=3) as s:
        ub = s.unit_blocks
        keys = list(range(20, 26))
        for u, k in enumerate(keys):
            fill(kv, u, ub, k)
        assert s.store(keys, np.arange(6 * ub)).ok
        assert s.flush(timeout_s=30)
        tiers = s.unit_tiers(keys)
        assert set(tiers) == {"both", "storage"}
    for f in mem_dir.iterdir():
        f.unlink()
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=3) as s:
        assert s.unit_tiers(keys) == ["storage"] * 6
        zero(kv)
        assert s.retrieve(keys, np.arange(6 * ub)).ok
        assert all(holds(kv, u, ub, k) for u, k in enumerate(keys))
        check_accounting(s)


def _slot(at: tuple[Path, int]) -> bytes:
    f, off = at
    with open(f, "rb") as fh:
        fh.seek(off)
        return fh.read(slot_bytes())


def test_both_copies_of_a_unit_are_the_same_bytes_after_a_flush_and_a_promotion(store_dirs, mem_dir):
    """A flush and a promotion copy the whole GPU file, header included (the same commit): the memory
    and storage slots of a unit hold identical bytes, partial units and inner keys too; a demoted
    and re-promoted unit reads back the same; the inner keys survive a lost memory tier."""
    from test_integrity import find_slots

    kv = make_kv(seed=19)
    keys = [31, 32, 33]
    inner = [[310, 311, 312], [320, 321, 322], [330]]  # the last unit holds 2 blocks
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=3) as s:
        ub = s.unit_blocks
        for u, k in enumerate(keys):
            fill(kv, u, ub, k)
        assert s.store(keys, np.arange(2 * ub + 2), inner_keys=inner).ok
        assert s.flush(timeout_s=30) and s.unit_tiers(keys) == ["both"] * 3
        raw = {k: s.read_unit(k) for k in keys}
        mem, disk = find_slots([mem_dir]), find_slots(store_dirs)
        for k in keys:
            assert _slot(mem[k]) == _slot(disk[k]) == raw[k], f"unit {k}: the flushed copy differs"
        assert s.store([40, 41, 42], np.arange(3 * ub)).ok  # demotes all three
        assert s.flush(timeout_s=30) and s.unit_tiers(keys) == ["storage"] * 3
        for _ in range(2):  # the second hit promotes
            zero(kv)
            assert s.retrieve(keys, np.arange(2 * ub + 2)).ok
        assert s.flush(timeout_s=30) and s.unit_tiers(keys) == ["both"] * 3
        mem, disk = find_slots([mem_dir]), find_slots(store_dirs)
        for k in keys:
            assert _slot(mem[k]) == _slot(disk[k]) == raw[k] == s.read_unit(k), f"unit {k}: the promoted copy differs"
        assert s.stored_blocks(keys) == [ub, ub, 2]
        assert all(holds(kv, u, ub, k) for u, k in enumerate(keys[:2]))
        want_inner = s.inner_keys()
        assert {i: want_inner[i] for i in (310, 311, 312, 320, 330)} == {310: 31, 311: 31, 312: 31, 320: 32, 330: 33}
    for f in mem_dir.iterdir():
        f.unlink()
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=3) as s:
        assert s.unit_tiers(keys) == ["storage"] * 3 and s.stored_blocks(keys) == [ub, ub, 2]
        assert s.inner_keys() == want_inner


@pytest.mark.parametrize("policy", POLICIES)
def test_an_imported_unit_lands_as_the_policy_says(store_dirs, mem_dir, policy):
    kv = make_kv(seed=20)
    with open_store([store_dirs[1]], kv) as src:
        ub = src.unit_blocks
        fill(kv, 0, ub, 51)
        assert src.store([51], np.arange(ub)).ok
        data = src.read_unit(51)
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=8, memory_slots=3, write_policy=policy) as s:
        assert s.import_unit(data) == 51
        want = {"write_through": "both", "memory_only": "memory", "write_back": None}[policy]
        if want:
            assert s.unit_tiers([51]) == [want]
        assert s.flush(timeout_s=30)
        assert s.unit_tiers([51]) == [want or "both"]
        hb = s.geometry()["header_bytes"]  # the header holds this store's commit sequence
        assert s.read_unit(51)[hb:] == data[hb:]
        zero(kv)
        assert s.retrieve([51], np.arange(ub)).ok and holds(kv, 0, ub, 51)
        check_accounting(s)


# ---- targeted races and contracts ----------------------------------------------------------------
def test_write_through_returns_only_once_the_storage_copy_is_committed(store_dirs, mem_dir):
    """write_through: `finish` returns once the storage copy is committed (options.h), so the unit is
    in both tiers the moment `store` returns, every time (the background flusher must not take the
    copy over and let `finish` return before it is done)."""
    kv = make_kv(seed=16)
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=64, memory_slots=4, write_policy="write_through") as s:
        ub = s.unit_blocks
        late = []
        for k in range(1, 301, 3):
            keys = [k, k + 1, k + 2]
            assert s.store(keys, np.arange(3 * ub)).ok
            late += [(key, t) for key, t in zip(keys, s.unit_tiers(keys)) if t != "both"]
        assert not late, f"{len(late)} of 300 units were stored without their storage copy: {late[:5]}"


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_flush_that_found_no_storage_slot_is_tried_again(store_dirs, mem_dir, policy):
    """Storage full of pinned units: the copy of a new unit to storage cannot take a slot. Once the
    pins go, the unit must still reach storage while the store is open (flush() waits for it), and
    until then flush_backlog counts it and flush() does not say all is flushed."""
    kv = make_kv(seed=17)
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=2, memory_slots=3, write_policy=policy) as s:
        ub = s.unit_blocks
        assert s.store([1, 2], np.arange(2 * ub)).ok
        assert s.flush(timeout_s=30) and s.unit_tiers([1, 2]) == ["both", "both"]
        s.pin([1, 2])
        assert s.store([3], np.arange(ub)).ok
        ok = s.flush(timeout_s=1)
        st_ = s.stats()
        assert s.unit_tiers([3]) == ["memory"]
        assert not ok or st_["flush_backlog"] == 1, (
            f"flush() said all is flushed and flush_backlog is {st_['flush_backlog']} while unit 3 is in memory only")
        s.unpin([1, 2])
        assert s.flush(timeout_s=30)
        assert s.unit_tiers([3]) == ["both"], "a unit whose flush once failed never reaches storage"


THREAD_UNITS = 240


@pytest.mark.parametrize("policy", POLICIES)
def test_threads_storing_reading_and_removing_while_units_move_between_tiers(store_dirs, mem_dir, policy):
    """One thread stores, two read (every unit twice: promotions), one removes, over a memory tier of
    3 slots before 12 storage slots (flushes, demotions and evictions all the time).
    Nothing is damaged, so every retrieve is byte-exact or a plain miss (never a checksum failure:
    a slot reused under a read), and afterwards the counters add up."""
    kv = make_kv(seed=18)
    stored: list[int] = []
    done: list[bool] = []
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=12, memory_slots=3, promote_hits=2,
                write_policy=policy) as s:
        ub = s.unit_blocks

        def writer() -> None:
            try:
                for k in range(1, THREAD_UNITS + 1, 2):
                    fill(kv, 0, ub, k)
                    fill(kv, 1, ub, k + 1)
                    res = s.store([k, k + 1], np.arange(2 * ub))
                    assert all(f.cause == "no_free_slot" for f in res.failures), res
                    stored.extend([k, k + 1][u] for u in res.committed_units)
            finally:
                done.append(True)

        def reader(unit: int, seed: int) -> None:
            rng = np.random.default_rng(seed)
            while not done:
                if not stored:
                    time.sleep(0.001)
                    continue
                k = int(stored[int(rng.integers(max(0, len(stored) - 16), len(stored)))])
                for _ in range(2):
                    res = s.retrieve([k], np.arange(unit * ub, (unit + 1) * ub))
                    if res.ok:
                        assert holds(kv, unit, ub, k), f"unit {k} read back wrong"
                    else:
                        assert [f.cause for f in res.failures] == ["not_present"], res

        def remover() -> None:
            rng = np.random.default_rng(3)
            for i in range(1, 40):
                while len(stored) < 6 * i and not done:  # one removal for every 6 units stored
                    time.sleep(0.001)
                s.remove(int(stored[int(rng.integers(len(stored)))]))

        run_threads(writer, lambda: reader(8, 1), lambda: reader(9, 2), remover)
        assert s.flush(timeout_s=30)
        st_ = s.stats()
        assert st_["checksum_failures"] == 0 and st_["io_errors"] == 0, st_
        moved = {k: st_[k] for k in ("promotions", "demotions", "evictions", "flushes")}
        if policy == "memory_only":
            assert moved["evictions"] > 0 and moved["flushes"] == moved["promotions"] == moved["demotions"] == 0, moved
        else:
            assert min(moved.values()) > 0, moved
        assert st_["hits"] == st_["memory_hits"] + st_["storage_hits"], st_
        check_accounting(s)
        for k in s.keys():
            zero(kv)
            assert s.retrieve([k], np.arange(ub)).ok and holds(kv, 0, ub, k), k


def test_flush_timeouts_are_waited_for_or_refused(store_dirs, mem_dir):
    """flush(timeout_s=inf) (or any huge timeout) waits like no limit, never returning False at once
    with the backlog untouched; NaN and negative timeouts are refused with a clear error."""
    kv = make_kv(seed=21)
    with tiered(store_dirs[0], mem_dir, kv, storage_slots=200, memory_slots=100) as s:
        ub = s.unit_blocks
        for i, timeout in enumerate([float("inf"), 1e300, float("inf")]):
            keys = list(range(1000 * i + 1, 1000 * i + 25))
            assert s.store(keys, np.arange(24 * ub)).ok
            done = s.flush(timeout_s=timeout)
            backlog = s.stats()["flush_backlog"]
            assert done and backlog == 0, f"flush(timeout_s={timeout}) returned {done} with {backlog} units waiting"
        for bad in (float("nan"), -1.0, -0.5):
            with pytest.raises(ValueError):  # ConfigError is one
                s.flush(timeout_s=bad)


# ---- 3. a model-checked state machine over every write policy ------------------------------------
KEYS = st.integers(1, 8)
NEVER = 1_000_000  # a key never stored: a retrieve of it drains evictions (on_evict)
SM_STORAGE_SLOTS, SM_MEMORY_SLOTS = 5, 2


class TierMachine(RuleBasedStateMachine):
    """A memory tier of 2 slots before 5 storage slots, against a model: `present` is what the store
    must hold (stored, minus what it reported evicted or removed), `seed` each key's bytes."""

    policy = "write_back"

    def __init__(self) -> None:
        super().__init__()
        self.storage = Path(tempfile.mkdtemp(prefix="tutti-sm-"))
        self.mem = shm_dir("tutti-sm-")
        self.kv = make_kv(seed=0)
        self.seed: dict[int, int] = {}
        self.present: set[int] = set()
        self.pins: set[int] = set()
        self.evicted: list[int] = []
        self.next_seed = 1
        self.s = self._open()
        self.ub = self.s.unit_blocks

    def _open(self):
        s = tiered(self.storage, self.mem, self.kv, storage_slots=SM_STORAGE_SLOTS, memory_slots=SM_MEMORY_SLOTS,
                   write_policy=self.policy, promote_hits=2)
        s.on_evict = self.evicted.append
        return s

    def teardown(self) -> None:
        self.s.close()
        shutil.rmtree(self.storage, ignore_errors=True)
        shutil.rmtree(self.mem, ignore_errors=True)

    def _sync(self, drain: bool = False) -> None:
        if drain:
            self.s.retrieve([NEVER], np.arange(self.ub))
        for k in self.evicted:
            assert k not in self.pins, f"pinned unit {k} was evicted"
            self.present.discard(k)
        self.evicted.clear()

    def _quiesce(self) -> None:
        assert self.s.flush(timeout_s=30)
        self._sync(drain=True)

    @rule(keys=st.lists(KEYS, min_size=1, max_size=3, unique=True))
    def store(self, keys):
        seeds = []
        for u, k in enumerate(keys):
            seeds.append(k * 1000 + self.next_seed)
            self.next_seed += 1
            fill(self.kv, u, self.ub, seeds[-1])
        # Evictions to make room come before the commits (reported by begin), later ones after.
        self._sync()
        req = self.s.begin_store(keys, np.arange(len(keys) * self.ub))
        self._sync()
        for layer in range(self.s.num_layers):
            self.s.store_layer(layer, req)
        res = self.s.finish(req)
        assert all(f.cause == "no_free_slot" for f in res.failures), res
        for u in res.committed_units:
            self.seed[keys[u]] = seeds[u]
            self.present.add(keys[u])
        self._sync()

    @rule(key=KEYS)
    def retrieve(self, key):
        self._sync()
        was = key in self.present
        dst = 4  # units 4.. of the KV blocks: never a store's source
        for l in range(len(self.kv)):
            self.kv[l][:, dst * self.ub:(dst + 1) * self.ub] = 0
        res = self.s.retrieve([key], np.arange(dst * self.ub, (dst + 1) * self.ub))
        if res.ok:
            assert was, f"unit {key} served though removed or evicted"
            assert holds(self.kv, dst, self.ub, self.seed[key]), f"unit {key} served with wrong bytes"
        else:
            assert [f.cause for f in res.failures] == ["not_present"], res
            self._sync()
            assert key not in self.present, f"unit {key} missed without being evicted or removed"

    @rule(key=KEYS)
    def retrieve_twice(self, key):  # a unit on storage only: the second hit promotes it
        self.retrieve(key)
        self.retrieve(key)

    @rule(key=KEYS)
    def remove(self, key):
        self._sync()
        was = key in self.present
        if self.s.remove(key):
            assert was, f"removed unit {key} that was not there"
            self.present.discard(key)
            return
        if key in self.pins or not was:
            return
        self._quiesce()  # being copied between tiers a moment ago: not now
        if key in self.present:
            assert self.s.remove(key), f"unit {key}, present and unpinned, is not removed"
            self.present.discard(key)

    # Draws never depend on the store's state (the flusher's timing decides some evictions), so
    # that hypothesis can replay a sequence: a rule that does not apply does nothing.
    @rule(key=KEYS)
    def pin(self, key):
        self._quiesce()
        if key in self.present and key not in self.pins and len(self.pins) < 2:
            self.s.pin([key])
            self.pins.add(key)

    @rule(key=KEYS)
    def unpin(self, key):
        if key in self.pins:
            self.s.unpin([key])
            self.pins.discard(key)

    @rule()
    def flush(self):
        self._quiesce()
        assert set(self.s.keys()) == self.present
        tiers = self.s.unit_tiers(sorted(self.present))
        if self.policy == "memory_only":
            assert set(tiers) <= {"memory"} and self.s.stats()["flushes"] == 0
        else:
            assert set(tiers) <= {"both", "storage"}, dict(zip(sorted(self.present), tiers))
        check_accounting(self.s)

    @rule()
    def reopen(self):
        self._quiesce()
        self.s.close()
        self.pins.clear()
        self.s = self._open()
        assert set(self.s.keys()) == self.present
        check_accounting(self.s)

    @invariant()
    def within_capacity(self):
        st_ = self.s.stats()
        assert st_["units"] <= st_["total_slots"] and st_["memory_units"] <= st_["memory_slots"]
        assert st_["memory_free_slots"] <= st_["memory_slots"] and st_["free_slots"] <= st_["total_slots"]
        assert st_["memory_slots"] == SM_MEMORY_SLOTS and st_["total_slots"] == SM_MEMORY_SLOTS + SM_STORAGE_SLOTS
        assert st_["hits"] == st_["memory_hits"] + st_["storage_hits"] and st_["memory_bytes_read"] <= st_["bytes_read"]
        for k in self.pins:
            assert self.s.lookup([k]) == 1, f"pinned unit {k} is gone"


@pytest.mark.parametrize("policy", POLICIES)
def test_state_machine_against_a_model(policy):
    machine = type(f"TierMachine_{policy}", (TierMachine,), {"policy": policy})
    run_state_machine_as_test(machine, settings=settings(max_examples=25, stateful_step_count=30, deadline=None,
                                                         database=None, suppress_health_check=list(HealthCheck)))


# ---- 4. integrity and attack tests of the single tier, re-run with a memory tier ------------------
# (module, test, write policy): memory_only keeps each unit's one copy in the memory tier, so the
# tests that damage bytes find them there (find_slots scans the memory tier too) and the tests that
# count slots (one per unit) keep their meaning; the others run write_back, with the flusher at work
# under them.
RERUN = [
    ("test_integrity", "test_finding1_iocb_exhaustion_never_serves_unloaded_kv", "write_back"),
    ("test_integrity", "test_finding1_iocb_exhaustion_never_commits_a_missing_layer", "write_back"),
    ("test_integrity", "test_finding1_finish_of_a_retrieve_with_unissued_layers_fails_every_unit", "write_back"),
    ("test_integrity", "test_finding1_finish_of_a_store_with_unissued_layers_commits_nothing", "write_back"),
    ("test_integrity", "test_finding2_two_bit31_flips_in_an_object_are_a_miss", "memory_only"),
    ("test_integrity", "test_finding2_two_bit31_flips_in_header_key_and_seq_leave_the_unit_absent", "memory_only"),
    ("test_integrity", "test_finding3_one_flipped_layout_id_byte_is_one_missing_unit", "memory_only"),
    ("test_integrity", "test_a_pool_of_another_layout_is_refused_naming_both", "memory_only"),
    ("test_integrity", "test_a_damaged_object_names_its_unit_pool_file_slot_and_the_checksum", "memory_only"),
    ("test_unit_store_attack", "test_remove_leaves_a_unit_a_retrieve_is_reading", "write_back"),
    ("test_unit_store_attack", "test_a_pool_file_of_another_layout_is_refused_with_none_of_its_units_left",
     "write_back"),
    ("test_partial_attack", "test_storing_a_partial_units_key_again_with_more_blocks_never_serves_zeros",
     "memory_only"),
    ("test_partial_attack", "test_threads_importing_one_partial_unit_keep_one_copy", "memory_only"),
]


@pytest.mark.parametrize("module,name,policy", RERUN, ids=[f"{n}-{p}" for _, n, p in RERUN])
def test_single_tier_tests_with_a_memory_tier(module, name, policy, store_dirs, tmp_path, monkeypatch):
    import importlib

    import test_integrity
    from tutti_cluster import TuttiConfig, TuttiStore

    mod = importlib.import_module(module)
    root = shm_dir("tutti-rerun-")
    mems: dict[tuple, Path] = {}

    def mem_for(dirs) -> Path:
        return mems.setdefault(tuple(str(d) for d in dirs), Path(tempfile.mkdtemp(dir=root)))

    def tiered_open(dirs, kv, layout="kv_first", **kw):
        return open_store(dirs, kv, layout, memory_paths=[mem_for(dirs)], memory_capacity_gb=0.01,
                          write_policy=policy, **kw)

    def fresh_reader(dirs, kv):
        r = TuttiStore(TuttiConfig(paths=dirs, unit_tokens=test_integrity.UNIT_TOKENS, memory_paths=[mem_for(dirs)],
                                   memory_capacity_gb=0.01))
        r.register_kv_caches(kv, block_tokens=16, read_only=True)
        return r

    used: list[bool] = []  # per store closed: whether units passed through its memory tier
    close = TuttiStore.close

    def closing(self) -> None:
        if self._native is not None:
            st_ = self.stats()
            used.append(st_["memory_slots"] > st_["memory_free_slots"] or st_["flushes"] > 0)
        close(self)

    monkeypatch.setattr(TuttiStore, "close", closing)
    find = test_integrity.find_slots
    monkeypatch.setattr(mod, "open_store", tiered_open)
    if module == "test_integrity":
        monkeypatch.setattr(mod, "find_slots", lambda dirs, instance="default": find([*dirs, mem_for(dirs)], instance))
        monkeypatch.setattr(mod, "fresh_reader", fresh_reader)
    fn = getattr(mod, name)
    args = {"store_dirs": store_dirs, "tmp_path": tmp_path}
    try:
        fn(**{p: args[p] for p in inspect.signature(fn).parameters})
        assert any(used), "no unit ever reached the memory tier: the test proves nothing about it"
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] == "writer":
        _writer(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))

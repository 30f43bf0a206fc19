"""KV blocks that meet the pool file's O_DIRECT alignment are read and written in place: one
scatter-gather I/O between the file and the blocks, no staging copy, the checksum taken over the
blocks themselves (the CPU backend; vLLM's CPU build allocates its KV cache page-aligned under
``THP_MEM_ALLOC_ENABLE=1``). Blocks that do not meet it, and units that skip blocks, go through
staging as before; damage is a miss either way."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import BLOCKS, LAYOUTS, make_kv, open_store, snapshot, zero
from test_integrity import find_slots, flip_bits, object_offset
from test_partial_units import blocks_equal
from tutti_cluster.store import SKIP_BLOCK

HEAD = 64  # a 16-token block is 4 KiB per object: a multiple of any O_DIRECT alignment


def aligned_kv(layout: str, seed: int, page_offset: int = 0) -> list:
    return make_kv(layout, seed=seed, head=HEAD, page_offset=page_offset)


@pytest.fixture
def disk(store_dirs):
    return store_dirs[:1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_aligned_blocks_move_in_place(disk, layout):
    kv = aligned_kv(layout, seed=1)
    with open_store(disk, kv, layout) as s:
        ub, n = s.unit_blocks, 5
        keys = list(range(10, 10 + n))
        src = np.random.default_rng(2).permutation(BLOCKS)[: n * ub]
        assert s.store(keys, src).ok
        stored = s.stats()["direct_ios"]
        assert stored > 0, "a store of aligned blocks went through staging"
        want = snapshot(kv)
        zero(kv)
        dst = np.random.default_rng(3).permutation(BLOCKS)[: n * ub]
        assert s.retrieve(keys, dst).ok
        assert s.stats()["direct_ios"] > stored, "a retrieve into aligned blocks went through staging"
        blocks_equal(want, src, kv, dst, layout)


def test_unaligned_blocks_and_skips_go_through_staging(disk):
    kv = aligned_kv("kv_first", seed=4, page_offset=64)  # torch's and numpy's usual place: 64 bytes past a page
    with open_store(disk, kv) as s:
        ub = s.unit_blocks
        assert s.store([1, 2], np.arange(2 * ub)).ok
        want = snapshot(kv)
        zero(kv)
        assert s.retrieve([1, 2], np.arange(2 * ub, 4 * ub)).ok
        if s.stats()["direct_io"]:
            assert s.stats()["direct_ios"] == 0
        blocks_equal(want, range(2 * ub), kv, range(2 * ub, 4 * ub))

    kv = aligned_kv("kv_first", seed=5)
    with open_store(disk, kv, instance="skip") as s:
        ub = s.unit_blocks
        assert s.store([1], np.arange(ub)).ok
        want = snapshot(kv)
        zero(kv)
        before = s.stats()["direct_ios"]
        dst = np.arange(ub, 2 * ub)
        dst[:2] = SKIP_BLOCK
        assert s.retrieve([1], dst).ok
        assert s.stats()["direct_ios"] == before  # the skipped blocks' bytes are summed in staging
        blocks_equal(want, range(2, ub), kv, dst[2:])
        assert not kv[0][:, ub : ub + 2].any()


@pytest.mark.parametrize("where", ["block", "missing block"])
def test_damage_under_a_direct_read_is_a_miss(disk, where):
    kv = aligned_kv("kv_first", seed=6)
    with open_store(disk, kv) as s:
        ub, g = s.unit_blocks, s.geometry()
        n = 2 * ub - 1  # the second unit partial: its last block is zeros in the file, summed from staging
        assert s.store([1, 2], np.arange(n)).ok
        want = snapshot(kv)
        path, head = find_slots(disk)[2]
        inside = g["block_bytes"] + 100 if where == "block" else (ub - 1) * g["block_bytes"] + 5
        flip_bits(path, head + object_offset(g, 2, 1) + inside, [3])
        zero(kv)
        before = s.stats()["direct_ios"]
        r = s.retrieve([1, 2], np.arange(2 * ub, 2 * ub + n))
        assert r.failed_units == [1]
        assert s.stats()["direct_ios"] > before
        blocks_equal(want, range(ub), kv, range(2 * ub, 3 * ub))

"""A prefix's last, partial unit: stored and served at block granularity, never padded into KV.

Every I/O path of the CPU backend: O_DIRECT through staging (a disk directory), scatter-gather
straight into the blocks (tmpfs with io_uring) and loads and stores on a mapped pool file (tmpfs,
map_memory_paths). Real files throughout.
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BLOCKS, LAYOUTS, assert_units_equal, make_kv, objects, open_store, snapshot, zero
from test_integrity import find_slots, header_format
from tutti_cluster import _native

PATHS = ["disk", "tmpfs-io_uring", "tmpfs-mapped"]


@pytest.fixture(params=PATHS)
def where(request, tmp_path):
    """(store directory, open_store options) for one I/O path."""
    if request.param == "disk":
        d = tmp_path / "disk"
        d.mkdir()
        return d, {}
    mount = request.getfixturevalue("tmpfs")
    return mount("64m"), {"map_memory_paths": request.param == "tmpfs-mapped", "capacity_gb": 0.004}


def blocks_equal(a: list, a_ids, b: list, b_ids, layout: str = "kv_first") -> None:
    """Blocks ``a_ids`` of KV ``a`` equal blocks ``b_ids`` of KV ``b``, in every layer and object."""
    for l in range(len(a)):
        for o, (x, y) in enumerate(zip(objects(a[l], layout), objects(b[l], layout))):
            np.testing.assert_array_equal(x[np.asarray(a_ids)], y[np.asarray(b_ids)], err_msg=f"layer {l} obj {o}")


@pytest.mark.parametrize("tail", [1, 3])
def test_partial_last_unit_round_trips_and_touches_no_other_block(where, tail):
    d, opts = where
    kv = make_kv(seed=tail)
    with open_store([d], kv, **opts) as s:
        ub = s.unit_blocks
        src = np.random.default_rng(tail).permutation(BLOCKS)[: 2 * ub + tail]
        res = s.store([11, 12, 13], src)
        assert res.ok and res.committed_units == [0, 1, 2]
        assert s.stored_blocks([11, 12, 13, 99]) == [ub, ub, tail, 0]
        want = snapshot(kv)
        zero(kv)
        dst = np.arange(BLOCKS - 2 * ub - tail, BLOCKS)
        assert s.retrieve([11, 12, 13], dst).ok
        blocks_equal(want, src, kv, dst)
        # Nothing else was written: the blocks before the destination are still zero.
        for layer in kv:
            assert not layer[:, : BLOCKS - 2 * ub - tail].any()
    # Across a reopen the block count comes back from the header.
    with open_store([d], kv, **opts) as s:
        assert s.stored_blocks([13]) == [tail]
        zero(kv)
        assert s.retrieve([13], np.arange(tail)).ok
        blocks_equal(want, src[2 * ub :], kv, np.arange(tail))


def test_asking_a_partial_unit_for_more_blocks_than_it_holds_is_a_miss(where):
    d, opts = where
    kv = make_kv(seed=5)
    with open_store([d], kv, **opts) as s:
        ub = s.unit_blocks
        assert s.store([21], np.arange(2)).ok
        zero(kv)
        res = s.retrieve([21], np.arange(10, 13))  # 3 blocks of a unit that holds 2
        assert res.failed_units == [0]
        assert not any(layer.any() for layer in kv)  # its zero tail never reached a block
        assert s.stored_blocks([21]) == [2]  # a miss, not damage: the unit stays
        assert s.retrieve([21], np.arange(10, 12)).ok
        assert ub > 2


def test_a_whole_unit_serves_a_prefix_of_its_blocks(where):
    d, opts = where
    kv = make_kv(seed=6)
    with open_store([d], kv, **opts) as s:
        ub = s.unit_blocks
        assert s.store([31, 32], np.arange(2 * ub)).ok
        want = snapshot(kv)
        zero(kv)
        assert s.retrieve([31, 32], np.arange(50, 50 + ub + 1)).ok  # all of unit 31, 1 block of 32
        blocks_equal(want, np.arange(ub + 1), kv, np.arange(50, 51 + ub))
        assert not any(layer[:, 51 + ub :].any() for layer in kv)


def test_every_layout_stores_partial_units(tmp_path):
    for layout in LAYOUTS:
        d = tmp_path / layout
        d.mkdir()
        kv = make_kv(layout, seed=7)
        with open_store([d], kv, layout) as s:
            ub = s.unit_blocks
            src = np.arange(ub + 2)
            assert s.store([41, 42], src).ok
            want = snapshot(kv)
            zero(kv)
            dst = np.arange(40, 40 + ub + 2)
            assert s.retrieve([41, 42], dst).ok
            assert_units_equal(want, src, kv, dst, layout, [0], ub)
            blocks_equal(want, src[ub:], kv, dst[ub:], layout)


def test_damage_in_a_partial_units_zero_tail_is_a_miss(tmp_path):
    """The object's bytes past the unit's blocks are zeros under the object's CRC32C: a flip there
    is found like any other (the unit is dropped), so a later longer read can never see them."""
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=8)
    with open_store([d], kv) as s:
        g = s.geometry()
        assert s.store([51], np.arange(1)).ok
    path, at = find_slots([d])[51]
    with open(path, "r+b") as f:
        f.seek(at + g["header_bytes"] + g["block_bytes"] + 100)  # inside object 0, past block 0
        assert f.read(1) == b"\0"
        f.seek(-1, 1)
        f.write(b"\x01")
    with open_store([d], kv) as s:
        assert s.retrieve([51], np.arange(1)).failed_units == [0]
        assert s.stored_blocks([51]) == [0]


def test_block_counts_out_of_range_are_refused(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=9)
    with open_store([d], kv) as s:
        ub = s.unit_blocks
        for keys, n in (([1, 2], ub), ([1, 2], 2 * ub + 1), ([1], 0), ([1, 2, 3], ub + 1)):
            with pytest.raises(Exception, match="only the last may hold fewer"):
                s.begin_store(keys, np.arange(n))
        assert s.lookup([1]) == 0


def test_a_partial_unit_is_not_scattered_as_a_whole_one(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=10)
    with open_store([d], kv) as s:
        assert s.store([61], np.arange(2)).ok
        data = s.read_unit(61)
        before = snapshot(kv)
        with pytest.raises(Exception, match="whole units"):
            s.scatter_unit(data, np.arange(s.unit_blocks) + 40)
        for a, b in zip(before, kv):
            np.testing.assert_array_equal(a, b)


def test_a_format_2_pool_is_read_as_whole_units(tmp_path):
    """Format 2 had no block word: its headers are read (and its units served) as whole units."""
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=11)
    with open_store([d], kv) as s:
        ub = s.unit_blocks
        num_objs = 2 * len(kv)  # kv_first: K and V objects per layer
        assert s.store([71], np.arange(ub)).ok
    want = snapshot(kv)
    _, fields, fixed = header_format()
    path, at = find_slots([d])[71]
    with open(path, "r+b") as f:
        f.seek(at)
        h = bytearray(f.read(fixed + 8 + 8 * num_objs))
        assert int.from_bytes(h[fixed : fixed + 8], "little") == ub
        v2 = h[:fixed] + h[fixed + 8 :]  # drop the block word
        voff, _ = fields["version"]
        v2[voff : voff + 4] = struct.pack("<I", 2)
        coff, _ = fields["header_checksum"]
        v2[coff : coff + 8] = bytes(8)
        v2[coff : coff + 8] = struct.pack("<Q", _native.crc32c(bytes(v2)))
        f.seek(at)
        f.write(bytes(v2) + bytes(8))
    with open_store([d], kv) as s:
        assert s.stored_blocks([71]) == [ub]
        zero(kv)
        assert s.retrieve([71], np.arange(ub)).ok
        blocks_equal(want, np.arange(ub), kv, np.arange(ub))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_request_shape_round_trips_or_misses_never_serving_zeros(tmp_path, data):
    """Property: stores of 1-4 units whose last holds 1..unit_blocks blocks, then retrieves of the same
    keys asking any block count for the last: byte-exact when it asks at most what the unit holds,
    else that unit is a miss; and no block outside the retrieve's is ever written."""
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    kv = make_kv(seed=data.draw(st.integers(0, 1000)))
    with open_store([d], kv) as s:
        ub = s.unit_blocks
        n = data.draw(st.integers(1, 4))
        held = data.draw(st.integers(1, ub))
        base = data.draw(st.integers(1, 1 << 40))
        keys = [base + i for i in range(n)]
        rng = np.random.default_rng(base)
        src = rng.permutation(BLOCKS)[: (n - 1) * ub + held]
        assert s.store(keys, src).ok
        assert s.stored_blocks(keys) == [ub] * (n - 1) + [held]
        ask = data.draw(st.integers(1, ub))
        want = snapshot(kv)
        zero(kv)
        dst = rng.permutation(BLOCKS)[: (n - 1) * ub + ask]
        res = s.retrieve(keys, dst)
        moved = dst if ask <= held else dst[: (n - 1) * ub]
        assert res.failed_units == ([] if ask <= held else [n - 1])
        blocks_equal(want, src[: len(moved)], kv, moved)
        untouched = np.setdiff1d(np.arange(BLOCKS), moved)
        for layer in kv:
            assert not layer[:, untouched].any()

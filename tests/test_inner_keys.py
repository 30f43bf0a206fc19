"""Inner block keys (header format 4): committed with a unit, found again after a reopen, gone with
the unit, and a damaged one is a damaged header (a miss), never a wrong name for a unit."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_kv, open_store, snapshot, zero
from test_integrity import find_slots, flip_bits, header_format
from test_partial_units import blocks_equal
from tutti_cluster import _native
from tutti_cluster.errors import LayoutError


def _inner(key: int, n: int) -> list[int]:
    return [key * 1000 + j for j in range(1, n + 1)]


def test_inner_keys_name_their_unit_across_a_reopen_and_go_with_it(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=41)
    with open_store([d], kv) as s:
        ub = s.unit_blocks
        # Two whole units and a partial one of 2 blocks: at most blocks - 1 inner keys are kept.
        assert s.store([1, 2, 3], np.arange(2 * ub + 2), [_inner(1, ub - 1), _inner(2, ub + 5), _inner(3, 9)]).ok
        want = {k: u for u in (1, 2) for k in _inner(u, ub - 1)} | {3001: 3}
        assert s.inner_keys() == want
        assert s.store([4], np.arange(ub)).ok  # none given: none kept
        assert s.inner_keys() == want
    with open_store([d], kv) as s:
        assert s.inner_keys() == want
        before = snapshot(kv)
        zero(kv)
        # What a lookup by inner key 1002 allows: the leading 2 blocks of unit 1.
        assert s.retrieve([s.inner_keys()[1002]], np.arange(80, 82)).ok
        blocks_equal(before, np.arange(2), kv, np.arange(80, 82))
        assert s.remove(1)
        assert s.inner_keys() == {k: u for k, u in want.items() if u != 1}
    with open_store([d], kv) as s:
        assert set(s.inner_keys().values()) == {2, 3}


def test_evicted_units_take_their_inner_keys_along(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=42)
    with open_store([d], kv) as s:
        ub, slots = s.unit_blocks, s.stats()["total_slots"]
        for k in range(1, slots + 3):  # every slot, then two more: the oldest two are evicted
            assert s.store([k], np.arange(ub), [_inner(k, 2)]).ok
        units = set(s.inner_keys().values())
        assert units == set(s.keys()) and 1 not in units and 2 not in units


def test_a_flipped_bit_in_an_inner_key_is_a_damaged_header(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=43)
    with open_store([d], kv) as s:
        ub, num_objs = s.unit_blocks, 2 * len(kv)
        assert s.store([7, 8], np.arange(2 * ub), [_inner(7, 3), _inner(8, 3)]).ok
    _, _, fixed = header_format()
    path, at = find_slots([d])[7]
    flip_bits(path, at + fixed + 8 + 8 * num_objs + 8, [5])  # inner key 7002
    with open_store([d], kv) as s:
        assert s.keys() == [8] and s.stats()["bad_headers"] == 1
        assert s.inner_keys() == {k: 8 for k in _inner(8, 3)}


def test_inner_keys_must_match_the_units(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=44)
    with open_store([d], kv) as s:
        ub = s.unit_blocks
        with pytest.raises(LayoutError, match="lists of inner keys for 2 units"):
            s.begin_store([1, 2], np.arange(2 * ub), [[5]])
        with pytest.raises(LayoutError, match="inner key counts"):
            s._e.begin(_native.ReqOp.STORE, np.array([1], np.uint64), np.arange(ub), np.array([5, 6], np.uint64),
                       np.array([1], np.uint32))
        with pytest.raises(LayoutError, match="together"):
            s._e.begin(_native.ReqOp.STORE, np.array([1], np.uint64), np.arange(ub), np.array([5], np.uint64), None)

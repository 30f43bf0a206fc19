"""A retrieve's skipped blocks (``SKIP_BLOCK``): read and checked with the rest of their unit, written
nowhere. The engine skips the leading blocks of a unit its prefix cache already holds (others may be
reading them), so a load never writes them, and a damaged unit is still a miss when the damage lies
in the skipped part. Every path: staging (O_DIRECT files), scatter-gather I/O straight into the
blocks (memory file systems), mapped pool files, and the remote path's scatter."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BLOCKS, LAYOUTS, make_kv, objects, open_store, refill, snapshot
from tutti_cluster.errors import LayoutError, NotFound
from tutti_cluster.store import SKIP_BLOCK

SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), max_examples=25)


def expected(before: list, want: list, src, dst, layout: str) -> list:
    """``before`` with block ``dst[i]`` of every object replaced by ``want``'s block ``src[i]``
    (for every i whose dst is not skipped)."""
    out = snapshot(before)
    for l in range(len(out)):
        a, b = objects(want[l], layout), objects(out[l], layout)
        for o in range(len(a)):
            for s, d in zip(src, dst):
                if d != SKIP_BLOCK:
                    b[o][d] = a[o][s]
    return out


def assert_kv_equal(got: list, want: list) -> None:
    for l, (a, b) in enumerate(zip(got, want)):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            np.testing.assert_array_equal(x, y, err_msg=f"layer {l}")


PATHS = [("disk", 64), ("disk", 48), ("direct", 64), ("mapped", 48)]  # 48: objects carry padding


@pytest.fixture(params=PATHS, ids=[f"{p}-{u}" for p, u in PATHS])
def store_at(request, tmp_path, tmpfs):
    path, unit_tokens = request.param
    if path == "disk":
        d = tmp_path / "ssd"
        d.mkdir()
    else:
        d = tmpfs("64m")
    opts = dict(unit_tokens=unit_tokens, capacity_gb=0.004, map_memory_paths=path == "mapped")

    def open_(kv, layout="kv_first"):
        return open_store([d], kv, layout, instance=layout, **opts)
    return open_


@pytest.mark.parametrize("layout", LAYOUTS)
def test_skipped_blocks_are_checked_and_left_alone(store_at, layout):
    kv = make_kv(layout, seed=3)
    with store_at(kv, layout) as s:
        ub = s.unit_blocks
        n_units = 6
        keys = list(range(100, 100 + n_units))
        rng = np.random.default_rng(5)
        src = rng.permutation(BLOCKS)[: n_units * ub]
        tail = n_units * ub - 1  # the last unit partial: one block short
        assert s.store(keys, src[:tail]).ok
        want = snapshot(kv)

        @settings(**SETTINGS)
        @given(mask=st.lists(st.booleans(), min_size=tail, max_size=tail), seed=st.integers(0, 2**32 - 1))
        def check(mask, seed):
            refill(kv, np.random.default_rng(seed))
            before = snapshot(kv)
            dst = np.random.default_rng(seed).permutation(BLOCKS)[:tail]
            ids = np.where(mask, SKIP_BLOCK, dst)
            res = s.retrieve(keys, ids)
            assert res.ok, res
            assert_kv_equal(kv, expected(before, want, src[:tail], ids, layout))

        check()
        assert s.stats()["checksum_failures"] == 0


def test_damage_in_skipped_blocks_is_a_miss(store_at):
    """The skipped part of a unit is checked: damage there fails the unit (none of its blocks is
    reported loaded), and the unit leaves the index."""
    kv = make_kv(seed=4)
    with store_at(kv) as s:
        ub, g = s.unit_blocks, s.geometry()
        assert s.store([1], np.arange(ub)).ok
    at = g["header_bytes"] + g["obj_bytes"] + 40  # slot 0 of file 0 (the unit): object 1, block 0
    with open(s.config.paths[0] / "tutti-kv_first.pool", "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))
    with store_at(kv) as s:
        ids = [SKIP_BLOCK] + list(range(50, 50 + ub - 1))
        res = s.retrieve([1], ids)
        assert res.failed_units == [0]
        assert s.stats()["checksum_failures"] == 1
        assert s.lookup([1]) == 0


def test_a_store_refuses_skipped_blocks_and_loses_nothing(store_at):
    kv = make_kv(seed=6)
    with store_at(kv) as s:
        ub = s.unit_blocks
        assert s.store([7], np.arange(ub)).ok
        before = s.stats()
        for ids in ([SKIP_BLOCK] + list(range(1, ub)), [-2] + list(range(1, ub))):
            with pytest.raises(LayoutError, match="out of range"):
                s.store([8], ids)
        with pytest.raises(LayoutError, match="retrieves only"):
            s.begin_store([8], [SKIP_BLOCK] * ub)
        after = s.stats()
        assert (after["units"], after["free_slots"]) == (before["units"], before["free_slots"])
        assert s.lookup([7, 8]) == 1
        assert s.store([8], np.arange(ub)).ok and s.lookup([7, 8]) == 2


def test_scatter_skips_blocks_and_checks_them(store_at):
    kv = make_kv(seed=8)
    with store_at(kv) as s:
        ub = s.unit_blocks
        assert s.store([9], np.arange(ub)).ok
        data = s.read_unit(9)
        want = snapshot(kv)
        refill(kv, np.random.default_rng(1))
        before = snapshot(kv)
        ids = np.array([SKIP_BLOCK, SKIP_BLOCK] + list(range(60, 60 + ub - 2)))
        s.scatter_unit(data, ids)
        assert_kv_equal(kv, expected(before, want, np.arange(ub), ids, "kv_first"))
        bad = bytearray(data)
        bad[s.geometry()["header_bytes"] + 8] ^= 0x01  # object 0, block 0: a skipped block
        with pytest.raises(NotFound, match="checksum"):
            s.scatter_unit(bad, ids)
        with pytest.raises(LayoutError, match="appears twice"):  # it would be written twice
            s.scatter_unit(data, [SKIP_BLOCK] + [60] * (ub - 1))


def test_the_connector_names_skipped_blocks_as_the_store_does():
    """The vLLM connector's metadata (imported where no store runs) carries the store's value."""
    pytest.importorskip("vllm")
    from tutti_cluster.vllm.metadata import SKIP_BLOCK as CONNECTOR_SKIP, Transfer

    assert CONNECTOR_SKIP == SKIP_BLOCK
    assert Transfer("r", [b"u"], [SKIP_BLOCK, SKIP_BLOCK, 7, 8]).written(1) == [7, 8]

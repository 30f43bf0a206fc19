"""Bad input: each case raises a clear TuttiError subclass, the process goes on, nothing committed is lost."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import BLOCKS, make_kv, open_store, snapshot, zero
from tutti_cluster import TuttiConfig, TuttiStore, errors
from tutti_cluster.kv_layout import LayerKV


@pytest.fixture
def live(store_dirs):
    """A store holding one committed unit (key 1), checked again after every bad call."""
    kv = make_kv(seed=21)
    s = open_store(store_dirs, kv)
    assert s.store([1], np.arange(s.unit_blocks)).ok
    want = snapshot(kv)

    def still_intact() -> None:
        zero(kv)
        assert s.retrieve([1], np.arange(s.unit_blocks)).ok
        for l in range(len(kv)):
            np.testing.assert_array_equal(want[l][:, : s.unit_blocks], kv[l][:, : s.unit_blocks])

    yield s, still_intact
    s.close()


def test_unknown_keys_are_misses(live):
    s, intact = live
    assert s.lookup([12345]) == 0
    assert s.retrieve([12345, 1], np.arange(2 * s.unit_blocks)).failed_units == [0]
    with pytest.raises(errors.NotFound):
        s.read_unit(12345)
    assert not s.remove(12345)
    intact()


@pytest.mark.parametrize(
    "blocks, match",
    [
        (lambda ub: np.arange(ub) + BLOCKS, "out of range"),
        (lambda ub: np.arange(ub) - 2, "out of range"),  # -1 alone is SKIP_BLOCK on a retrieve
        (lambda ub: np.arange(ub, dtype=np.uint64) - np.uint64(1), "out of range"),  # 2**64 - 1 is not -1
        (lambda ub: np.arange(ub + 1), "block ids for"),  # one unit holds at most unit_blocks
        (lambda ub: np.arange(ub, dtype=np.float32), "integers"),
        (lambda ub: np.arange(ub).reshape(1, ub), "one-dimensional"),
    ],
)
def test_bad_block_ids(live, blocks, match):
    s, intact = live
    for begin in (s.begin_retrieve, s.begin_store):
        with pytest.raises(errors.LayoutError, match=match):
            begin([2], blocks(s.unit_blocks))
    intact()


def test_a_block_named_twice_in_one_retrieve_is_refused(live):
    """Two units (or one) writing one block would leave it torn, each source passing its checksum."""
    s, intact = live
    ub = s.unit_blocks
    for ids in (np.r_[np.arange(ub), np.arange(ub)], np.r_[[-1], np.arange(ub - 1), np.arange(ub - 1, 2 * ub - 1)]):
        ids[-1] = ids[1 if ids[0] >= 0 else 2]
        with pytest.raises(errors.LayoutError, match="appears twice"):
            s.begin_retrieve([1, 2], ids)
    intact()


def test_bad_layers_and_requests(live):
    s, intact = live
    req = s.begin_retrieve([1], np.arange(s.unit_blocks))
    with pytest.raises(errors.LayoutError, match="layer 99"):
        s.retrieve_layer(99, req)
    with pytest.raises(errors.TuttiError, match="retrieve request"):
        s.store_layer(0, req)
    s.retrieve_layer(0, req)
    with pytest.raises(errors.TuttiError, match="already issued"):
        s.retrieve_layer(0, req)
    with pytest.raises(errors.TuttiError, match="was not issued"):
        s.wait_layer(1, req)
    s.finish(req)
    with pytest.raises(errors.TuttiError, match="no request"):
        s.finish(req)
    with pytest.raises(errors.LayoutError):
        s.lookup([1.5])  # type: ignore[list-item]
    intact()


def test_incomplete_store_is_never_visible(live):
    s, intact = live
    req = s.begin_store([7], np.arange(s.unit_blocks))
    s.store_layer(0, req)  # the other layers never come
    res = s.finish(req)
    assert res.failed_units == [0] and s.lookup([7]) == 0
    intact()


def test_wrong_shapes_dtypes_layouts(store_dirs, tmp_path):
    kv = make_kv(seed=22)
    with pytest.raises(errors.LayoutError, match="infer"):
        open_store(store_dirs, [np.zeros((BLOCKS, 16, 64), np.uint16)] * 2, layout="auto")
    with pytest.raises(errors.LayoutError, match="kv_first"):
        open_store(store_dirs, [np.zeros((3, BLOCKS, 16), np.uint16)], layout="kv_first")
    mixed = [kv[0], kv[1].view(np.int16).astype(np.float32)]
    with pytest.raises(errors.LayoutError, match="differs"):
        open_store(store_dirs, mixed)
    with pytest.raises(errors.LayoutError, match="contiguous"):
        open_store(store_dirs, [kv[0][:, :, ::2]])
    with pytest.raises(errors.LayoutError, match="torch tensor or numpy"):
        open_store(store_dirs, ["not a tensor"], layout="mla")
    with pytest.raises(errors.LayoutError, match="multiple of 4"):
        open_store(store_dirs, [LayerKV((kv[0].ctypes.data,), 6, 6, 4)])
    with pytest.raises(errors.ConfigError, match="multiple of block_tokens"):
        open_store(store_dirs, kv, unit_tokens=40)
    with pytest.raises(errors.ConfigError, match="staging"):
        open_store(store_dirs, kv, staging_mb=1, unit_tokens=16384)
    with pytest.raises(errors.ConfigError, match="below one GPU file"):
        open_store(store_dirs, kv, capacity_gb=1e-6)
    with pytest.raises(errors.ConfigError, match="unit_tokens"):
        TuttiStore(TuttiConfig(), unit_tokens=0)
    with pytest.raises(errors.ConfigError, match="must be a TuttiConfig"):
        TuttiStore({"paths": []})  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError, match="capacity_gb"):
        from tutti_cluster.config import load_config
        load_config(paths=["/a", "/b", "/c"], capacity_gb=[1, 2])


def test_other_layout_in_pool_is_refused_and_kept(store_dirs):
    kv = make_kv(seed=23)
    with open_store(store_dirs, kv) as s:
        assert s.store([1], np.arange(s.unit_blocks)).ok
    other = make_kv("block_first", layers=2, seed=24)
    with pytest.raises(errors.LayoutError, match="another layout"):
        open_store(store_dirs, other, layout="block_first")
    with open_store(store_dirs, kv) as s:
        assert s.lookup([1]) == 1


def test_second_process_on_same_share_is_refused(store_dirs):
    kv = make_kv(seed=25)
    with open_store(store_dirs, kv):
        with pytest.raises(errors.ConfigError, match="in use"):
            open_store(store_dirs, kv)
        with open_store(store_dirs, kv, instance="rank1") as other:
            assert other.lookup([1]) == 0


def test_missing_and_read_only_directories(tmp_path, tmpfs):
    kv = make_kv(seed=26)
    with pytest.raises(errors.StorageError, match="No such file"):
        open_store([tmp_path / "nope"], kv)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(errors.StorageError, match="not a directory"):
        open_store([f], kv)
    ro = tmpfs("1m", ro=True)
    with pytest.raises(errors.StorageError, match="not writable|Read-only"):
        open_store([ro], kv)


def test_full_disk(tmp_path, tmpfs):
    kv = make_kv(seed=27)
    small = tmpfs("1m")
    with pytest.raises(errors.CapacityExceeded, match="no space left"):
        open_store([small], kv, capacity_gb=0.01)
    assert not any(p.stat().st_size for p in small.iterdir())  # nothing half-made is left in use
    # Preallocation means a running store never meets ENOSPC on its data path.
    g = 0.0009
    with open_store([small], kv, capacity_gb=g) as s:
        n = s.stats()["total_slots"]
        # One request cannot hold more GPU files than the pool has: the surplus units fail.
        res = s.store(list(range(1, n + 3)), np.arange((n + 2) * s.unit_blocks) % BLOCKS)
        assert res.failed_units == [n, n + 1]
        # Later requests evict the least recently used units instead.
        res = s.store([1000, 1001], np.arange(2 * s.unit_blocks))
        assert res.ok and s.stats()["evictions"] == 2
    # A failed open gives back only what it preallocated from empty: files with data stay.
    with pytest.raises(errors.CapacityExceeded, match="no space left"):
        open_store([small], kv, capacity_gb=0.01)
    with open_store([small], kv, capacity_gb=g) as s:
        assert s.lookup([1000, 1001]) == 2


def test_falls_back_to_buffered_where_o_direct_is_refused(tmpfs):
    kv = make_kv(seed=28)
    d = tmpfs(fstype="ramfs")  # ramfs has no direct I/O (tmpfs gained it in Linux 6.6)
    with open_store([d], kv, capacity_gb=0.005) as s:
        assert s.stats()["direct_io"] is False
        assert s.store([1], np.arange(s.unit_blocks)).ok
    with pytest.raises(errors.StorageError, match="O_DIRECT refused"):
        open_store([d], kv, capacity_gb=0.005, direct_io="on")


def test_closed_store(store_dirs):
    s = open_store(store_dirs, make_kv(seed=29))
    s.close()
    with pytest.raises(errors.TuttiError, match="closed"):
        s.lookup([1])
    s.close()  # idempotent
    assert os.path.exists(store_dirs[0] / "tutti-default.pool")


@pytest.mark.parametrize("argv", [["bench", "--quick", "--paths"], ["up", "--demo", "--paths"]])
def test_cli_reports_bad_input_in_one_line(tmp_path, capsys, argv):
    """The console script turns a TuttiError into one line on stderr and status 2, no traceback."""
    from tutti_cluster.cli import main

    assert main([*argv, str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tutti: error:") and "missing" in last and "Traceback" not in err

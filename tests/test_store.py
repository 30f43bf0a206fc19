"""The single-node store on the CPU backend: round trips, hits, paths, capacity, recovery."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import BLOCKS, LAYOUTS, UNIT_TOKENS, assert_units_equal, make_kv, open_store, snapshot, zero
from tutti_cluster import TuttiConfig, TuttiStore
from tutti_cluster.keys import chain_keys, to_key
from tutti_cluster.kv_layout import layers_from_cross_layer_tensor



@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_random_permutations(store_dirs, layout):
    kv = make_kv(layout, seed=1)
    rng = np.random.default_rng(7)
    with open_store(store_dirs, kv, layout) as s:
        ub = s.unit_blocks
        keys = [rng.integers(1 << 62) for _ in range(10)]
        src_blocks = rng.permutation(BLOCKS)[: len(keys) * ub]
        res = s.store(keys, src_blocks)
        assert res.ok and res.committed_units == list(range(10))
        assert s.lookup(keys) == 10
        want = snapshot(kv)
        zero(kv)
        dst_blocks = rng.permutation(BLOCKS)[: len(keys) * ub]
        res = s.retrieve(keys, dst_blocks)
        assert res.ok, res
        assert_units_equal(want, src_blocks, kv, dst_blocks, layout, list(range(10)), ub)
        # Blocks outside the request stay untouched (zero).
        untouched = sorted(set(range(BLOCKS)) - set(dst_blocks.tolist()))
        first = kv[0][0] if isinstance(kv[0], tuple) else kv[0]
        axis_blocks = first if layout != "kv_first" else first[0]
        if layout in ("block_first",):
            axis_blocks = first[:, 0]
        assert not np.any(axis_blocks[untouched])


def test_layer_by_layer_and_bytes_keys(store_dirs):
    kv = make_kv(seed=2)
    with open_store(store_dirs, kv) as s:
        keys = [f"unit-{i}".encode() for i in range(6)]
        blocks = np.arange(6 * s.unit_blocks)[::-1].copy()
        req = s.begin_store(keys, blocks)
        for layer in reversed(range(s.num_layers)):  # any order
            s.store_layer(layer, req)
            s.wait_layer(layer, req)
        assert s.finish(req).ok
        want = snapshot(kv)
        zero(kv)
        req = s.begin_retrieve(keys, blocks)
        for layer in range(s.num_layers):
            s.retrieve_layer(layer, req)
        for layer in range(s.num_layers):
            s.wait_layer(layer, req)
        assert s.finish(req).ok
        for l in range(s.num_layers):
            np.testing.assert_array_equal(want[l][:, blocks], kv[l][:, blocks])


def test_cross_layer_tensor(store_dirs):
    rng = np.random.default_rng(3)
    big = rng.integers(0, 65535, (BLOCKS, 4, 2, 16, 2, 32), dtype=np.uint16)
    layers = layers_from_cross_layer_tensor(big, 4)
    with open_store(store_dirs, layers) as s:
        keys = [11, 12, 13]
        blocks = rng.permutation(BLOCKS)[: 3 * s.unit_blocks]
        assert s.store(keys, blocks).ok
        want = big.copy()
        big[...] = 0
        assert s.retrieve(keys, blocks).ok
        np.testing.assert_array_equal(want[blocks], big[blocks])


def test_partial_hits_and_prefix_lookup(store_dirs):
    kv = make_kv(seed=4)
    with open_store(store_dirs, kv) as s:
        tokens = list(range(10 * UNIT_TOKENS + 5))
        keys = chain_keys(tokens, UNIT_TOKENS)
        assert len(keys) == 10
        assert s.lookup(keys) == 0
        assert s.store(keys[:4], np.arange(4 * s.unit_blocks)).ok
        assert s.lookup(keys) == 4
        assert s.store(keys[6:8], np.arange(2 * s.unit_blocks)).ok
        assert s.lookup(keys) == 4  # a gap ends the hit prefix
        # A second store of present units skips them.
        res = s.store(keys[:5], np.arange(5 * s.unit_blocks))
        assert res.skipped_units == 4 and res.committed_units == [4]
        assert s.lookup(keys) == 5
        # Retrieving a key that is absent is a miss for that unit only.
        res = s.retrieve([keys[0], 999, keys[1]], np.arange(3 * s.unit_blocks))
        assert res.failed_units == [1]


def test_units_stripe_round_robin_over_paths(tmp_path):
    dirs = [tmp_path / f"p{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    kv = make_kv(seed=5)
    with open_store(dirs, kv, capacity_gb=[0.004, 0.004, 0.004]) as s:
        keys = list(range(1, 10))
        assert s.store(keys, np.arange(9 * s.unit_blocks)).ok
        slot = s.geometry()["slot_bytes"]
    counts = []
    for d in dirs:
        data = (d / "tutti-default.pool").read_bytes()
        counts.append(sum(data[i : i + 8] == b"VKNUTTI1"[::-1] or data[i:i+8] == (0x31495454554e4b56).to_bytes(8, "little")
                          for i in range(0, len(data), slot)))
    assert counts == [3, 3, 3]


def test_lru_eviction_and_pins(tmp_path):
    d = tmp_path / "ssd"
    d.mkdir()
    kv = make_kv(seed=6)
    probe = open_store([d], kv, capacity_gb=1.0)
    slot = probe.geometry()["slot_bytes"]
    probe.close()
    (d / "tutti-default.pool").unlink()
    cap_gb = 6 * slot / (1 << 30)  # room for exactly six units
    evicted: list[int] = []
    with open_store([d], kv, capacity_gb=cap_gb) as s:
        s.on_evict = evicted.append
        ub = s.unit_blocks
        assert s.stats()["total_slots"] == 6
        assert s.store([1, 2, 3, 4, 5, 6], np.arange(6 * ub)).ok
        s.pin([1])
        s.lookup([2])  # 2 becomes most recently used
        assert s.store([7, 8], np.arange(2 * ub)).ok
        assert sorted(evicted) == [3, 4]  # LRU, skipping pinned 1 and touched 2
        assert s.lookup([1]) == 1 and s.lookup([2]) == 1 and s.lookup([3]) == 0
        # With everything pinned nothing can be evicted: the new units fail, the process goes on.
        s.pin([2, 5, 6, 7, 8])
        res = s.store([9], np.arange(ub))
        assert res.failed_units == [0]
        assert s.lookup([9]) == 0
        s.unpin([1, 2, 5, 6, 7, 8])
        s.unpin([1])
        assert s.store([9], np.arange(ub)).ok


def test_restart_recovers_every_committed_unit(store_dirs):
    kv = make_kv(seed=8)
    rng = np.random.default_rng(8)
    keys = list(range(100, 112))
    with open_store(store_dirs, kv) as s:
        src = rng.permutation(BLOCKS)[: 12 * s.unit_blocks]
        assert s.store(keys, src).ok
        s.remove(keys[0])
    want = snapshot(kv)
    zero(kv)
    with open_store(store_dirs, kv) as s:
        assert s.lookup(keys) == 0 and s.lookup(keys[1:]) == 11
        dst = rng.permutation(BLOCKS)[: 12 * s.unit_blocks]
        res = s.retrieve(keys[1:], dst[s.unit_blocks :])
        assert res.ok
        assert_units_equal(want, src[s.unit_blocks :], kv, dst[s.unit_blocks :], "kv_first", list(range(11)), s.unit_blocks)


def test_corrupt_object_is_a_reported_miss(store_dirs):
    kv = make_kv(seed=9)
    with open_store(store_dirs, kv) as s:
        ub = s.unit_blocks
        g = s.geometry()
        keys = [1, 2, 3, 4]
        assert s.store(keys, np.arange(4 * ub)).ok
    # Flip bytes inside the third object of the first slot of path 0 (unit with key 1 or 3).
    pool = store_dirs[0] / "tutti-default.pool"
    with open(pool, "r+b") as f:
        f.seek(g["header_bytes"] + 2 * g["obj_bytes"] + 100)
        f.write(b"\xff\x00\xff\x00")
    want = snapshot(kv)
    zero(kv)
    with open_store(store_dirs, kv) as s:
        res = s.retrieve(keys, np.arange(4 * ub) + 40)
        assert len(res.failed_units) == 1
        bad = res.failed_units[0]
        # The corrupt unit is reported as not loaded (the engine recomputes its blocks); every other
        # unit arrived byte-exact.
        ub_ = s.unit_blocks
        for u in range(4):
            if u == bad:
                continue
            for l in range(len(kv)):
                np.testing.assert_array_equal(kv[l][:, 40 + u * ub_ : 40 + (u + 1) * ub_], want[l][:, u * ub_ : (u + 1) * ub_])
        assert s.stats()["checksum_failures"] == 1
        assert s.lookup([keys[bad]]) == 0  # dropped from the index
        good = [k for i, k in enumerate(keys) if i != bad]
        assert s.retrieve(good, np.arange(3 * ub)).ok


def test_read_import_scatter_unit(tmp_path, store_dirs):
    kv = make_kv(seed=10)
    other = tmp_path / "other"
    other.mkdir()
    with open_store(store_dirs, kv) as a:
        ub = a.unit_blocks
        assert a.store([42], np.arange(ub)).ok
        data = a.read_unit(42)
        assert len(data) == a.geometry()["slot_bytes"]
        want = snapshot(kv)
        kv2 = make_kv(seed=11)
        with open_store([other], kv2) as b:
            assert b.import_unit(data) == 42
            assert b.lookup([42]) == 1
            b.scatter_unit(data, np.arange(ub) + 10)
            for l in range(len(kv)):
                np.testing.assert_array_equal(want[l][:, :ub], kv2[l][:, 10 : 10 + ub])
            bad = bytearray(data)
            bad[-100] ^= 0xFF  # inside the last object
            from tutti_cluster.errors import NotFound
            with pytest.raises(NotFound, match="checksum"):
                b.scatter_unit(bad, np.arange(ub) + 30)
            zero(kv2)
            assert b.retrieve([42], np.arange(ub) + 20).ok
            for l in range(len(kv)):
                np.testing.assert_array_equal(want[l][:, :ub], kv2[l][:, 20 : 20 + ub])


def test_scatter_unit_async_tickets(tmp_path, store_dirs):
    """Asynchronous scatters (the remote path's, ordered on the engine's stream on CUDA): each ticket
    gives its own verdict once, at most four are in flight, the store keeps each unit's buffer until
    its wait, and closing with scatters in flight loses nothing else."""
    from tutti_cluster.errors import CapacityExceeded, LayoutError, NotFound, TuttiError

    kv = make_kv(seed=14)
    with open_store(store_dirs, kv) as a:
        ub = a.unit_blocks
        assert a.store([1, 2], np.arange(2 * ub)).ok
        units = [bytearray(a.read_unit(k)) for k in (1, 2)]
        want = snapshot(kv)
    bad = bytearray(units[1])
    bad[-100] ^= 0x01  # one bit of the second unit's last object
    kv2 = make_kv(seed=15)
    other = tmp_path / "other"
    other.mkdir()
    with open_store([other], kv2) as b:
        sources = [units[0], bad, units[1], units[0]]
        tickets = [b.scatter_unit_async(src, np.arange(ub) + 10 * (i + 1)) for i, src in enumerate(sources)]
        assert len(set(tickets)) == 4
        with pytest.raises(CapacityExceeded, match="4 scatters in flight"):
            b.scatter_unit_async(units[0], np.arange(ub) + 60)
        with pytest.raises(BufferError):
            bad.extend(b"x")  # held by the store until its wait
        with pytest.raises(LayoutError):  # bad arguments raise at once and take no slot
            b.scatter_unit_async(units[0], np.arange(ub - 1))
        b.scatter_wait(tickets[0])
        with pytest.raises(NotFound, match="checksum"):
            b.scatter_wait(tickets[1])
        bad.extend(b"x")  # released by its wait, failed or not
        for t in tickets[2:]:
            b.scatter_wait(t)
        for t in (tickets[0], tickets[1], 0, 1 << 60):
            with pytest.raises(TuttiError, match="no scatter"):
                b.scatter_wait(t)  # each ticket once; unknown ones refused
        for i, (src_key, dst) in enumerate([(0, 10), (1, 30), (0, 40)]):
            for l in range(len(kv)):
                np.testing.assert_array_equal(want[l][:, src_key * ub:(src_key + 1) * ub], kv2[l][:, dst:dst + ub])
        # Slots are free again; close with two in flight.
        b.scatter_unit_async(units[0], np.arange(ub) + 50)
        b.scatter_unit_async(units[1], np.arange(ub) + 60)
    for l in range(len(kv)):
        np.testing.assert_array_equal(want[l][:, ub:2 * ub], kv2[l][:, 60:60 + ub])
    units[0].extend(b"x")  # close released the buffers


def test_scatter_unit_from_registered_host_memory(tmp_path, store_dirs):
    """Units scattered from a registered buffer (as the remote path's arena is): byte-exact, a
    corrupt one is a miss; the store keeps the buffer exported until unregister_host or close."""
    from tutti_cluster.errors import NotFound

    kv = make_kv(seed=12)
    with open_store(store_dirs, kv) as a:
        ub = a.unit_blocks
        assert a.store([7], np.arange(ub)).ok
        data = a.read_unit(7)
        want = snapshot(kv)
    arena = bytearray(2 * len(data))
    arena[:len(data)] = data
    arena[len(data):] = data
    arena[-100] ^= 0xFF  # the second copy's last object
    kv2 = make_kv(seed=13)
    other = tmp_path / "other"
    other.mkdir()
    with open_store([other], kv2) as b:
        addr = b.register_host(arena)
        with pytest.raises(BufferError):
            arena.extend(b"x")  # exported while registered
        view = memoryview(arena)
        b.scatter_unit(view[:len(data)], np.arange(ub) + 5)
        for l in range(len(kv)):
            np.testing.assert_array_equal(want[l][:, :ub], kv2[l][:, 5:5 + ub])
        with pytest.raises(NotFound, match="checksum"):
            b.scatter_unit(view[len(data):], np.arange(ub) + 5)
        view.release()
        b.unregister_host(addr)
        b.unregister_host(addr)  # a second time: nothing
        arena.extend(b"x")
        b.register_host(arena)
    arena.extend(b"x")  # close released it


def test_gio_uring_api(store_dirs):
    kv = make_kv(seed=12)
    with open_store(store_dirs, kv, iocb_depth=8) as s:
        ub = s.unit_blocks
        assert s.store([5, 6], np.arange(2 * ub)).ok
        want = snapshot(kv)
        zero(kv)
        req = s.begin_retrieve([5, 6], np.arange(2 * ub))
        for layer in range(s.num_layers):
            (iocb,) = s.get_iocb(1)
            s.fill_iocb(iocb, op="read", layer=layer, req=req, first=0, count=4)
            s.issue_io([iocb], sms=8)
            assert s.wait_cqe(iocb) == 0
            s.put_iocb(iocb)
        s.finish(req)
        for l in range(len(kv)):
            np.testing.assert_array_equal(want[l][:, : 2 * ub], kv[l][:, : 2 * ub])
        from tutti_cluster.errors import CapacityExceeded
        with pytest.raises(CapacityExceeded):
            s.get_iocb(9)


def test_key_mapping():
    assert to_key(5) == 5
    assert to_key(-1) == (1 << 64) - 1
    assert to_key(b"abc") == to_key(bytearray(b"abc")) != to_key(b"abd")
    assert chain_keys(list(range(130)), 64) == chain_keys(list(range(128)), 64)
    assert chain_keys(list(range(128)), 64, b"rank1") != chain_keys(list(range(128)), 64)


def test_config_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TUTTI_PATHS", f"{tmp_path}/a, {tmp_path}/b")
    monkeypatch.setenv("TUTTI_CAPACITY_GB", "1,2")
    monkeypatch.setenv("TUTTI_UNIT_TOKENS", "512")
    cfg = TuttiConfig()
    assert [str(p) for p in cfg.paths] == [f"{tmp_path}/a", f"{tmp_path}/b"]
    assert cfg.capacity_bytes() == [1 << 30, 2 << 30]
    assert cfg.unit_tokens == 512
    assert TuttiConfig(unit_tokens=128).unit_tokens == 128  # arguments win over the environment
    assert not cfg.cluster_mode


def test_embedded_default_uses_data_dir(tmp_path):
    kv = make_kv(seed=13)
    s = TuttiStore(TuttiConfig(data_dir=tmp_path / "node", capacity_gb=0.01, unit_tokens=UNIT_TOKENS, staging_mb=2))
    s.register_kv_caches(kv, block_tokens=16)
    assert (tmp_path / "node" / "store" / "tutti-default.pool").exists()
    s.close()


def test_extent_map_for_640k_tokens_fits_32_mib(tmp_path):
    """The P2P memory map of a 640K-token Llama-3-8B prefix in random block order: at most 32 MiB."""
    from tutti_cluster import LayerKV

    tokens = 640 * 1024
    nb = tokens // 16
    base = np.zeros(64, np.uint8)  # descriptors only: every unit is a miss, so no byte moves
    layers = [LayerKV((base.ctypes.data, base.ctypes.data + 32), 32768, 32768, nb) for _ in range(32)]
    s = TuttiStore(TuttiConfig(paths=[tmp_path], capacity_gb=0.04, instance="map640"))
    s.register_kv_caches(layers, block_tokens=16)
    res = s.retrieve(list(range(tokens // 256)), np.random.default_rng(0).permutation(nb))
    assert len(res.failed_units) == tokens // 256
    st = s.stats()
    assert 0 < st["extent_map_bytes"] <= 32 << 20
    assert st["staging_bytes"] == TuttiConfig().staging_mb << 20  # fixed, whatever the context length
    s.close()


def test_several_pool_files_per_path(tmp_path, tmpfs):
    kv = make_kv(seed=31)
    disk = tmp_path / "disk"
    disk.mkdir()
    mem = tmpfs("16m")
    rng = np.random.default_rng(31)
    with open_store([disk], kv, pool_files=3, capacity_gb=0.009) as s:
        assert sorted(p.name for p in disk.iterdir()) == [
            "tutti-default.1.pool", "tutti-default.2.pool", "tutti-default.pool"]
        keys = list(range(1, 13))
        src = rng.permutation(BLOCKS)[: 12 * s.unit_blocks]
        assert s.store(keys, src).ok
    with open_store([mem], kv, capacity_gb=0.009) as s:  # memory file system: 16 files by default
        assert len(list(mem.iterdir())) == 16
        assert s.store(keys, src).ok
        slot = s.stats()["slot_bytes"]
    small = tmpfs("4m")
    with open_store([small], kv, capacity_gb=3 * slot / (1 << 30)):  # room for 3 GPU files: 3 pool files
        assert len(list(small.iterdir())) == 3
    want = snapshot(kv)
    for d in (disk, mem):
        zero(kv)
        with open_store([d], kv, capacity_gb=0.009, pool_files=3 if d == disk else 0) as s:
            assert s.lookup(keys) == 12
            dst = rng.permutation(BLOCKS)[: 12 * s.unit_blocks]
            assert s.retrieve(keys, dst).ok
            assert_units_equal(want, src, kv, dst, "kv_first", list(range(12)), s.unit_blocks)
        reader = TuttiStore(TuttiConfig(paths=[d], unit_tokens=UNIT_TOKENS))  # finds every file
        reader.register_kv_caches(kv, block_tokens=16, read_only=True)
        assert reader.lookup(keys) == 12
        reader.close()


def test_read_unit_into_and_reader_refresh(store_dirs):
    import mmap

    kv = make_kv(seed=32)
    with open_store(store_dirs, kv) as w:
        assert w.store([1], np.arange(w.unit_blocks)).ok
        reader = TuttiStore(TuttiConfig(paths=store_dirs, unit_tokens=UNIT_TOKENS))
        reader.register_kv_caches(w.layers, block_tokens=16, read_only=True)
        assert reader.lookup([1, 2]) == 1
        assert w.store([2], np.arange(w.unit_blocks)).ok
        assert reader.lookup([2]) == 0
        reader.refresh()  # sees the commit made since it opened
        assert reader.lookup([1, 2]) == 2
        n = w.geometry()["slot_bytes"]
        aligned = mmap.mmap(-1, n)  # page aligned: read in place with O_DIRECT
        assert reader.read_unit_into(2, aligned) == n
        assert bytes(aligned) == w.read_unit(2)
        odd = bytearray(n + 1)
        assert reader.read_unit_into(2, memoryview(odd)[1:]) == n  # unaligned: bounced
        assert bytes(odd[1:]) == bytes(aligned)
        from tutti_cluster.errors import CapacityExceeded, NotFound, TuttiError
        with pytest.raises(CapacityExceeded):
            reader.read_unit_into(2, bytearray(100))
        with pytest.raises(NotFound):
            reader.read_unit_into(3, aligned)
        with pytest.raises(TuttiError, match="read-only"):
            w.refresh()
        reader.close()


def test_read_unit_into_without_verify_leaves_the_checksums_to_the_consumer(store_dirs):
    """The node daemon serves remote reads with verify=False: the header is still checked, and a
    corrupt object is caught where the bytes are consumed (scatter_unit, import_unit)."""
    import mmap

    from tutti_cluster.errors import NotFound

    kv = make_kv(seed=33)
    with open_store(store_dirs, kv) as s:
        ub = s.unit_blocks
        g = s.geometry()
        assert s.store([5], np.arange(ub)).ok
        pool = store_dirs[0] / "tutti-default.pool"
        with open(pool, "r+b") as f:  # the store's only unit sits in the first slot of path 0
            f.seek(g["header_bytes"] + g["obj_bytes"] + 7)
            f.write(b"\x5a\xa5")
        buf = mmap.mmap(-1, g["slot_bytes"])
        with pytest.raises(NotFound, match="checksum"):
            s.read_unit_into(5, buf)
        assert s.read_unit_into(5, buf, verify=False) == g["slot_bytes"]
        with pytest.raises(NotFound, match="checksum"):
            s.scatter_unit(buf, np.arange(ub) + 10)
        with pytest.raises(NotFound, match="checksum"):
            s.import_unit(buf)
        with pytest.raises(NotFound):
            s.read_unit_into(6, buf, verify=False)  # absent
        buf[:8] = b"\0" * 8  # a header that is not one: caught without verify as well
        with open(pool, "r+b") as f:
            f.write(bytes(buf[: g["header_bytes"]]))
        with pytest.raises(NotFound, match="header"):
            s.read_unit_into(5, buf, verify=False)


@pytest.mark.parametrize("mapped", [False, True], ids=["io_uring", "mapped"])
@pytest.mark.parametrize("unit_tokens", [64, 48])  # 48: objects carry alignment padding
def test_memory_fs_moves_straight_between_file_and_blocks(tmpfs, unit_tokens, mapped):
    """On tmpfs the CPU I/O kernel skips staging: scatter-gather I/O into the KV blocks with the
    checksum taken in place, or (map_memory_paths) copies from the mapped pool file that checksum as
    they go. Every layout round-trips and a corrupt object is still a reported miss."""
    d = tmpfs("64m")
    rng = np.random.default_rng(unit_tokens)
    opts = dict(unit_tokens=unit_tokens, capacity_gb=0.004, map_memory_paths=mapped)
    for layout in LAYOUTS:
        kv = make_kv(layout, seed=unit_tokens)
        with open_store([d], kv, layout, instance=layout, **opts) as s:
            n_files = len(list(d.glob(f"tutti-{layout}*.pool")))
            assert n_files > 1  # several pool files on a memory file system
            assert s.stats()["mapped_files"] == (n_files if mapped else 0)
            ub = s.unit_blocks
            keys = list(range(1, 9))
            src = rng.permutation(BLOCKS)[: 8 * ub]
            assert s.store(keys, src).ok
            want = snapshot(kv)
            zero(kv)
            dst = rng.permutation(BLOCKS)[: 8 * ub]
            assert s.retrieve(keys, dst).ok
            assert_units_equal(want, src, kv, dst, layout, list(range(8)), ub)
            g = s.geometry()
        pool = d / f"tutti-{layout}.pool"  # slot 0 of file 0 holds the first unit
        with open(pool, "r+b") as f:
            f.seek(g["header_bytes"] + g["obj_bytes"] - 8)  # last bytes of object 0 (padding, if any)
            f.write(b"\x01\x02\x03\x04\x05\x06\x07\x08")
        with open_store([d], kv, layout, instance=layout, **opts) as s:
            res = s.retrieve(keys, dst)
            assert res.failed_units == [0]
            assert s.lookup(keys[:1]) == 0


def test_mapped_and_io_uring_paths_share_one_format(tmpfs, tmp_path):
    """A store with map_memory_paths keeps io_uring for paths that are not memory file systems and
    writes the same files: units stored through the mapping load through io_uring and back."""
    shm, disk = tmpfs("64m"), tmp_path / "disk"
    disk.mkdir()
    rng = np.random.default_rng(5)
    kv = make_kv(seed=5)
    keys = list(range(1, 13))
    for store_mapped in (True, False):
        with open_store([shm, disk], kv, map_memory_paths=store_mapped, instance=f"m{store_mapped}") as s:
            ub = s.unit_blocks
            n_files = len(list(shm.glob(f"tutti-m{store_mapped}*.pool")))
            assert n_files > 1  # several pool files on a memory file system
            assert s.stats()["mapped_files"] == (n_files if store_mapped else 0)  # the disk path: never
            src = rng.permutation(BLOCKS)[: 12 * ub]
            assert s.store(keys, src).ok
        want = snapshot(kv)
        zero(kv)
        with open_store([shm, disk], kv, map_memory_paths=not store_mapped, instance=f"m{store_mapped}") as s:
            dst = rng.permutation(BLOCKS)[: 12 * ub]
            res = s.retrieve(keys, dst)
            assert res.ok, res.failed_units
            assert_units_equal(want, src, kv, dst, "kv_first", list(range(12)), ub)


def test_mapped_requests_back_to_back(tmpfs):
    """Hundreds of short requests on mapped pool files: every one completes byte-exact while the
    engine releases each request as soon as its last object is reported done."""
    d = tmpfs("64m")
    kv = make_kv(seed=21)
    with open_store([d], kv, capacity_gb=0.02, map_memory_paths=True) as s:
        ub = s.unit_blocks
        assert s.store([1, 2, 3], np.arange(3 * ub)).ok
        want = snapshot(kv)
        for i in range(400):
            n = 1 + i % 3
            dst = np.arange(3 * ub, (3 + n) * ub)
            res = s.retrieve([1, 2, 3][:n], dst)
            assert res.ok, (i, res.failed_units)
        assert_units_equal(want, np.arange(3 * ub), kv, np.arange(3 * ub, 6 * ub), "kv_first", [0, 1, 2], ub)


def test_config_file_sits_below_the_environment(monkeypatch, tmp_path):
    import json

    from tutti_cluster.errors import ConfigError

    f = tmp_path / "tutti.json"
    f.write_text(json.dumps({"unit_tokens": 128, "queue_depth": 32}))
    monkeypatch.setenv("TUTTI_CONFIG_FILE", str(f))
    monkeypatch.setenv("TUTTI_QUEUE_DEPTH", "16")
    cfg = TuttiConfig()
    assert cfg.unit_tokens == 128 and cfg.queue_depth == 16
    f.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        TuttiConfig()


def _unwritten_bytes(path: Path) -> int | None:
    """Bytes of ``path`` in unwritten extents (FIEMAP), or None where the file system cannot say."""
    import fcntl
    import struct

    fs_ioc_fiemap, n_ext, unwritten, last = 0xC020660B, 128, 0x800, 0x1
    total, start = 0, 0
    while True:
        out = bytearray(struct.pack("=QQLLLL", start, (1 << 64) - 1 - start, 0, 0, n_ext, 0) + bytes(56 * n_ext))
        try:
            with open(path, "rb") as f:
                fcntl.ioctl(f.fileno(), fs_ioc_fiemap, out, True)
        except OSError:
            return None
        mapped = struct.unpack_from("=L", out, 20)[0]
        if mapped == 0:
            return total
        for i in range(mapped):
            logical, _phys, length, _r1, _r2, flags = struct.unpack_from("=QQQQQL", out, 32 + 56 * i)
            total += length if flags & unwritten else 0
            start = logical + length
            if flags & last:
                return total


def test_prewrite_leaves_no_unwritten_extents(tmp_path):
    """fallocate leaves unwritten extents on ext4/XFS, and O_DIRECT stores into them convert extents
    under the file's exclusive lock; prewrite_pool (the default) zeroes them once at first open."""
    kv = make_kv(seed=34)
    cold, warm = tmp_path / "cold", tmp_path / "warm"
    cold.mkdir()
    warm.mkdir()
    with open_store([cold], kv, prewrite_pool=False) as s:
        assert s.store([1], np.arange(s.unit_blocks)).ok
    want = snapshot(kv)
    before = _unwritten_bytes(cold / "tutti-default.pool")
    if not before:
        pytest.skip("this file system reports no unwritten extents after fallocate (nothing to prewrite)")
    with open_store([warm], kv) as s:
        assert _unwritten_bytes(warm / "tutti-default.pool") == 0
        assert s.store([1], np.arange(s.unit_blocks)).ok
    with open_store([cold], kv) as s:  # an existing pool is completed on the next open, data kept
        assert _unwritten_bytes(cold / "tutti-default.pool") == 0
        zero(kv)
        assert s.retrieve([1], np.arange(s.unit_blocks) + 7).ok
        for l in range(len(kv)):
            np.testing.assert_array_equal(kv[l][:, 7 : 7 + s.unit_blocks], want[l][:, : s.unit_blocks])


def test_prewrite_keeps_a_pool_copied_a_moment_ago(tmp_path):
    """A pool copied with buffered writes is still in the page cache, without blocks: fallocate must
    not turn it into unwritten extents that the prewrite then zeroes."""
    import shutil

    kv = make_kv(seed=35)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    with open_store([src], kv) as s:
        ub = s.unit_blocks
        assert s.store([1, 2, 3], np.arange(3 * ub)).ok
    want = snapshot(kv)
    shutil.copytree(src, dst)  # buffered copy; nothing synced
    zero(kv)
    with open_store([dst], kv) as s:
        assert s.lookup([1, 2, 3]) == 3
        assert s.retrieve([1, 2, 3], np.arange(3 * ub) + 5).ok
        for l in range(len(kv)):
            np.testing.assert_array_equal(kv[l][:, 5 : 5 + 3 * ub], want[l][:, : 3 * ub])

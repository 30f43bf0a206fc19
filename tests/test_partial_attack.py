"""Adversarial tests of two features: partial last units (native core) and deferred writes (the
vLLM connector's ``defer_saves``).

Real files and the real store throughout (CPU backend): disk directories (O_DIRECT through
staging), small tmpfs mounts (io_uring scatter-gather straight into the blocks, or mapped with
``map_memory_paths``), child processes killed with SIGKILL. The only injected faults are a
monkeypatched ``TuttiStore.done`` that keeps writes "running" (a slow device), each marked so.

Tests commented "Regression (once failed)" reproduce a bug that was fixed; the others guard
behaviour that holds today.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import BLOCK_TOKENS, BLOCKS, HEAD, HEADS, make_kv, objects, open_store, refill, run_threads, snapshot, zero
from test_integrity import find_slots, header_format
from test_partial_units import blocks_equal
from tutti_cluster import TuttiConfig, TuttiStore, _native
from tutti_cluster.errors import LayoutError, NotFound, TuttiError
from tutti_cluster.store import SKIP_BLOCK

HERE = Path(__file__).resolve().parent


def _untouched(kv: list, ids, layout: str = "kv_first") -> None:
    ids = np.asarray(ids)
    if ids.size == 0:
        return
    for l in range(len(kv)):
        for o, x in enumerate(objects(kv[l], layout)):
            assert not x[ids].any(), f"layer {l} obj {o}: a block outside the retrieve was written"


def _no_leak(s: TuttiStore) -> None:
    """No request, pin or slot left behind: every slot is free or holds a unit, every IOCB is free."""
    st = s.stats()
    assert st["pinned"] == 0, st
    assert st["free_slots"] + st["units"] == st["total_slots"], st
    assert not s._ops, s._ops
    ids = s.get_iocb(s.config.iocb_depth)  # the whole table: nothing is held
    for i in ids:
        s.put_iocb(i)


@pytest.fixture(params=["disk", "disk-buffered", "tmpfs-io_uring", "tmpfs-mapped", "disk+tmpfs-mapped"])
def where(request, tmp_path):
    """(store directories, open_store options) for one I/O path, or two paths of different kinds
    in one store (units round-robin over them)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if request.param.startswith("disk") and "+" not in request.param:
        return [disk], {"capacity_gb": 0.004, "direct_io": "off" if request.param == "disk-buffered" else "auto"}
    t = request.getfixturevalue("tmpfs")("64m")
    opts = {"map_memory_paths": request.param != "tmpfs-io_uring", "capacity_gb": 0.004}
    return ([disk, t] if "+" in request.param else [t]), opts


# ==== partial last units: the native core ==========================================================
def test_random_partial_requests_on_every_path_are_exact_or_miss_and_leak_nothing(where):
    """Random requests of 1-4 units whose last holds 1..unit_blocks blocks, under eviction
    pressure (the pool holds about 60 units), retrieved asking any count for the last unit."""
    dirs, opts = where
    kv = make_kv(seed=21)
    rng = np.random.default_rng(21)
    with open_store(dirs, kv, **opts) as s:
        ub = s.unit_blocks
        for _ in range(60):
            n, tail = int(rng.integers(1, 5)), int(rng.integers(1, ub + 1))
            keys = [int(k) for k in rng.integers(1, 1 << 62, n)]
            src = rng.permutation(BLOCKS)[: (n - 1) * ub + tail]
            refill(kv, rng)
            want = snapshot(kv)
            assert s.store(keys, src).ok
            assert s.stored_blocks(keys) == [ub] * (n - 1) + [tail]
            ask = int(rng.integers(1, ub + 1))
            zero(kv)
            dst = rng.permutation(BLOCKS)[: (n - 1) * ub + ask]
            res = s.retrieve(keys, dst)
            moved = dst if ask <= tail else dst[: (n - 1) * ub]
            assert res.failed_units == ([] if ask <= tail else [n - 1]), (res, ask, tail)
            blocks_equal(want, src[: len(moved)], kv, moved)
            _untouched(kv, np.setdiff1d(np.arange(BLOCKS), moved))
        assert s.stats()["evictions"] > 0
        _no_leak(s)


@pytest.mark.parametrize("mode", ["tmpfs-io_uring", "tmpfs-mapped", "disk"])
def test_units_at_the_scatter_gather_limit(tmp_path, tmpfs, mode):
    """513 blocks per unit (objects padded to 4 KiB), every block id apart: on tmpfs a unit's K
    and V move as one scatter-gather I/O of blocks + padding: 1028 iovecs for a whole unit (over
    IOV_MAX: through staging then), exactly 1024 for 511 blocks; partial tails of 511, 512, 513
    and 1 blocks, asked for fewer, as many, and one more."""
    d = tmpfs("100m") if mode.startswith("tmpfs") else tmp_path / "disk"
    d.mkdir(exist_ok=True)
    nb = 1100
    kv = make_kv(layers=2, blocks=nb, seed=22)
    rng = np.random.default_rng(22)
    cfg = TuttiConfig(paths=[d], capacity_gb=0.05, unit_tokens=513 * BLOCK_TOKENS, staging_mb=8,
                      min_io_bytes=4096, map_memory_paths=mode == "tmpfs-mapped")
    with TuttiStore(cfg) as s:
        s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS)
        ub = s.unit_blocks
        for tail in (511, 512, 513, 1):
            for ask in sorted({1, tail - 1, tail, min(tail + 1, ub)} - {0}):
                keys = [int(k) for k in rng.integers(1, 1 << 62, 2)]
                src = rng.permutation(nb)[: ub + tail]
                refill(kv, rng)
                want = snapshot(kv)
                assert s.store(keys, src).ok
                zero(kv)
                dst = rng.permutation(nb)[: ub + ask]
                res = s.retrieve(keys, dst)
                moved = dst if ask <= tail else dst[:ub]
                assert res.failed_units == ([] if ask <= tail else [1]), (tail, ask, res)
                blocks_equal(want, src[: len(moved)], kv, moved)
                _untouched(kv, np.setdiff1d(np.arange(nb), moved))
        _no_leak(s)


@pytest.mark.parametrize("mode", ["tmpfs-io_uring", "tmpfs-mapped", "disk"])
def test_partial_tails_and_alignment_padding_together(tmp_path, tmpfs, mode):
    """Blocks of 12 bytes: a whole unit's 48 bytes sit in a 4 KiB object, so every object is mostly
    padding, and a partial unit's missing blocks and the padding make one zero tail."""
    d = tmpfs("64m") if mode.startswith("tmpfs") else tmp_path / "disk"
    d.mkdir(exist_ok=True)
    rng = np.random.default_rng(35)
    nb = 64
    kv = [rng.integers(0, 65535, (2, nb, 3, 2), dtype=np.uint16) for _ in range(3)]
    cfg = TuttiConfig(paths=[d], capacity_gb=0.002, unit_tokens=12, staging_mb=1, min_io_bytes=4096,
                      map_memory_paths=mode == "tmpfs-mapped")
    with TuttiStore(cfg) as s:
        s.register_kv_caches(kv, block_tokens=3, layout="kv_first")
        ub = s.unit_blocks
        assert s.geometry()["obj_bytes"] == 4096 and s.geometry()["block_bytes"] == 12
        for _ in range(80):
            n, tail = int(rng.integers(1, 5)), int(rng.integers(1, ub + 1))
            keys = [int(k) for k in rng.integers(1, 1 << 62, n)]
            src = rng.permutation(nb)[: (n - 1) * ub + tail]
            refill(kv, rng)
            want = snapshot(kv)
            assert s.store(keys, src).ok
            ask = int(rng.integers(1, ub + 1))
            zero(kv)
            dst = rng.permutation(nb)[: (n - 1) * ub + ask]
            res = s.retrieve(keys, dst)
            moved = dst if ask <= tail else dst[: (n - 1) * ub]
            assert res.failed_units == ([] if ask <= tail else [n - 1]), (res, ask, tail)
            blocks_equal(want, src[: len(moved)], kv, moved)
            _untouched(kv, np.setdiff1d(np.arange(nb), moved))
        assert s.stats()["evictions"] > 0
        _no_leak(s)


@pytest.mark.parametrize("layout", ["block_first", "kv_tuple", "interleaved", "mla"])
@pytest.mark.parametrize("mapped", [True, False])
def test_every_layout_moves_partial_units_on_tmpfs(tmpfs, layout, mapped):
    d = tmpfs("16m")
    kv = make_kv(layout, seed=36)
    with open_store([d], kv, layout, map_memory_paths=mapped, capacity_gb=0.004) as s:
        ub = s.unit_blocks
        src = np.random.default_rng(36).permutation(BLOCKS)[: ub + 3]
        assert s.store([11, 12], src).ok
        want = snapshot(kv)
        for ask in (1, 3, 4):
            zero(kv)
            dst = np.arange(50, 50 + ub + ask)[::-1]
            res = s.retrieve([11, 12], dst)
            moved = dst if ask <= 3 else dst[:ub]
            assert res.failed_units == ([] if ask <= 3 else [1]), res
            blocks_equal(want, src[: len(moved)], kv, moved, layout)
            _untouched(kv, np.setdiff1d(np.arange(BLOCKS), moved), layout)
        _no_leak(s)


def test_refused_partial_requests_hold_nothing(tmp_path):
    """Requests refused at begin (a block id out of range in the partial last unit, the IOCB table
    too small) and one whose layers did not all move: no pin, slot or IOCB is left, nothing is
    committed, and the stored unit is still served."""
    from tutti_cluster.errors import CapacityExceeded

    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=37)
    with open_store([d], kv, iocb_depth=6) as s:
        ub = s.unit_blocks
        assert s.store([1, 2], np.arange(ub + 2)).ok
        for op in (s.begin_retrieve, s.begin_store):
            with pytest.raises(LayoutError, match="out of range"):
                op([1, 2] if op == s.begin_retrieve else [3, 4], list(range(ub)) + [5, BLOCKS])
        held = s.get_iocb(3)
        with pytest.raises(CapacityExceeded):
            s.begin_retrieve([1, 2], np.arange(ub + 2))
        for i in held:
            s.put_iocb(i)
        req = s.begin_store([5, 6], np.arange(ub + 1))
        for layer in range(s.num_layers - 1):  # the last layer never moves
            s.store_layer(layer, req)
        res = s.finish(req)
        assert res.incomplete_layers == [s.num_layers - 1] and not res.committed_units, res
        assert s.stored_blocks([5, 6]) == [0, 0]
        req = s.begin_retrieve([1, 2], np.arange(40, 42 + ub))
        s.retrieve_layer(0, req)
        res = s.finish(req)
        assert res.failed_units == [0, 1] and s.stored_blocks([1, 2]) == [ub, 2], res
        _no_leak(s)
    with open_store([d], kv) as s:
        assert s.stored_blocks([1, 2, 5, 6]) == [ub, 2, 0, 0] and s.stats()["bad_headers"] == 0
        assert s.retrieve([1, 2], np.arange(ub + 2)).ok


def test_a_partial_last_unit_in_a_layers_second_iocb(tmp_path, tmpfs):
    """1101 units of 2 objects: 2202 IOCTXs a layer, so two IOCBs a layer, the partial last unit in
    the second one; retrieved asking as many blocks as it holds, and one more (the whole units
    read and checked, and skipped: a retrieve writes each block once)."""
    d = tmpfs("100m")
    kv = make_kv(blocks=128, seed=23)
    with open_store([d], kv, capacity_gb=0.08, map_memory_paths=False) as s:
        ub = s.unit_blocks
        n = 1101
        keys = list(range(1000, 1000 + n))
        src = np.concatenate([(np.arange(ub) + (u % 23) * ub) for u in range(n - 1)] + [np.array([100, 101])])
        want = snapshot(kv)
        res = s.store(keys, src)
        assert res.ok and len(res.committed_units) == n
        assert s.stored_blocks(keys[-2:]) == [ub, 2]
        for ask, ok in ((2, True), (3, False)):
            zero(kv)
            dst = np.concatenate([np.full((n - 1) * ub, SKIP_BLOCK), np.arange(110, 110 + ask)])
            res = s.retrieve(keys, dst)
            assert res.failed_units == ([] if ok else [n - 1]), res
            if ok:
                blocks_equal(want, [100, 101], kv, [110, 111])
            _untouched(kv, np.arange(110 + (2 if ok else 0), 128))
        _no_leak(s)


def test_the_gio_uring_api_moves_a_partial_last_unit_and_a_miss_writes_nothing(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=24)
    with open_store([d], kv) as s:
        ub = s.unit_blocks
        src = np.arange(ub + 3)
        req = s.begin_store([71, 72], src)  # 2 units x 2 objects: IOCTXs [0, 4)
        ids = s.get_iocb(2)
        for layer in range(s.num_layers):  # each layer in two ranges, the partial unit alone
            for iocb, (first, count) in zip(ids, ((0, 2), (2, 2))):
                s.fill_iocb(iocb, op="write", layer=layer, req=req, first=first, count=count)
            s.issue_io(ids)
            assert [s.wait_cqe(i) for i in ids] == [0, 0]
        res = s.finish(req)
        assert res.ok and res.committed_units == [0, 1] and not res.incomplete_layers, res
        assert s.stored_blocks([71, 72]) == [ub, 3]
        want = snapshot(kv)
        for ask in (3, 2, 4):
            zero(kv)
            dst = np.arange(40, 40 + ub + ask)
            req = s.begin_retrieve([71, 72], dst)
            for layer in range(s.num_layers):
                s.fill_iocb(ids[0], op="read", layer=layer, req=req, first=0, count=4)
                s.issue_io([ids[0]])
                assert s.wait_cqe(ids[0]) == 0
            res = s.finish(req)
            if ask <= 3:
                assert res.ok and not res.incomplete_layers, res
                blocks_equal(want, src[: ub + ask], kv, dst)
                _untouched(kv, np.setdiff1d(np.arange(BLOCKS), dst))
            else:
                assert res.failed_units == [1], res
                blocks_equal(want, src[:ub], kv, dst[:ub])
                _untouched(kv, np.setdiff1d(np.arange(BLOCKS), dst[:ub]))
        for i in ids:
            s.put_iocb(i)
        assert s.stored_blocks([71, 72]) == [ub, 3]
        _no_leak(s)


RAW_DURING_FINISH = r"""
import sys, threading, time
sys.path.insert(0, sys.argv[2])
import numpy as np
from pathlib import Path
from conftest import make_kv, open_store
from tutti_cluster.errors import TuttiError

kv = make_kv(seed=1)
s = open_store([Path(sys.argv[1])], kv, capacity_gb=0.05)
ub = s.unit_blocks
n = 200  # the last unit partial (2 blocks): a retrieve long enough that finish waits a while
keys = list(range(1, n + 1))
ids = np.concatenate([np.arange(ub) + (u % 20) * ub for u in range(n - 1)] + [np.arange(90, 92)])
assert s.store(keys, ids).ok
# A retrieve writes each block once: units past the 20th (their blocks reused) are skipped (-1).
rids = np.where(np.arange(len(ids)) < 20 * ub, ids, -1)
rids[-2:] = ids[-2:]
(iocb,) = s.get_iocb(1)
late = 0
for _ in range(150):
    req = s.begin_retrieve(keys, rids)
    for layer in range(s.num_layers):
        s.retrieve_layer(layer, req)
    t = threading.Thread(target=s.finish, args=(req,))
    t.start()
    time.sleep(0.0005)  # finish is now waiting for the layers
    try:
        s.fill_iocb(iocb, op="read", layer=0, req=req, first=0, count=2 * n)
        s.issue_io([iocb])
        late += 1
    except TuttiError:
        pass  # refused: the request is finishing
    t.join()
    s.wait_cqe(iocb)
s.put_iocb(iocb)
assert s.stats()["pinned"] == 0
print("ok", late)
"""


def test_a_gio_uring_iocb_issued_while_its_request_finishes(tmp_path):
    """Thread A finishes a retrieve (with a partial last unit) whose layers are still reading;
    meanwhile thread B fills a gio_uring IOCB against that request and issues it. Either call
    must be refused, or finish must wait for that IOCB too ("a request is released only after
    the gio_uring IOCBs filled against it are done"). In a child process: a crash fails the test."""
    # Regression (once failed): the child died with SIGSEGV. Store::finish collected the IOCBs to
    # wait for under mu_, waited without it and released the request, while an IOCB filled and
    # issued in between ran on over the released request's view. Now finish marks the request
    # finishing first, and fill_iocb/issue_io/layer refuse it.
    d = tmp_path / "d"
    d.mkdir()
    r = subprocess.run([sys.executable, "-c", RAW_DURING_FINISH, str(d), str(HERE)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, f"child exited {r.returncode}: {r.stderr[-2000:]}"


def _block_word_at(d: Path, key: int) -> tuple[Path, int]:
    path, at = find_slots([d])[key]
    return path, at + header_format()[2]


def test_every_flipped_bit_of_the_block_word_is_a_miss(tmp_path):
    """Each of the 64 bits of a partial unit's block word flipped on disk: the header no longer
    verifies, so the unit is an empty slot (a miss, counted bad), never a unit of another size."""
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=25)
    with open_store([d], kv) as s:
        assert s.store([81, 82], np.arange(s.unit_blocks + 2)).ok
    want = snapshot(kv)
    path, word = _block_word_at(d, 82)
    raw = bytearray(path.read_bytes())
    assert int.from_bytes(raw[word : word + 8], "little") == 2
    for bit in range(64):
        bad = bytearray(raw)
        bad[word + bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bad)
        with open_store([d], kv) as s:
            assert s.stored_blocks([81, 82]) == [s.unit_blocks, 0], bit
            assert s.stats()["bad_headers"] == 1
            zero(kv)
            assert s.retrieve([82], np.arange(1)).failed_units == [0]
            _untouched(kv, np.arange(BLOCKS))
    path.write_bytes(raw)
    with open_store([d], kv) as s:
        zero(kv)
        assert s.retrieve([81, 82], np.arange(s.unit_blocks + 2)).ok
        blocks_equal(want, np.arange(s.unit_blocks + 2), kv, np.arange(s.unit_blocks + 2))


@pytest.mark.parametrize("word", [0, 5, 1 << 32 | 2, 1 << 63, (1 << 64) - 1])
def test_an_out_of_range_block_word_under_a_valid_checksum_is_refused(tmp_path, word):
    """A block word of 0, above unit_blocks, or one whose low 32 bits are in range (a truncation
    would read 2), with the header checksum recomputed so that only the range check stands."""
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=26)
    with open_store([d], kv) as s:
        ub, num_objs = s.unit_blocks, 2 * len(kv)
        assert s.store([91], np.arange(2)).ok
    _, fields, fixed = header_format()
    path, at = find_slots([d])[91]
    with open(path, "r+b") as f:
        f.seek(at)
        h = bytearray(f.read(fixed + 8 + 8 * num_objs))
        h[fixed : fixed + 8] = struct.pack("<Q", word)
        coff, _ = fields["header_checksum"]
        h[coff : coff + 8] = bytes(8)
        h[coff : coff + 8] = struct.pack("<Q", _native.crc32c(bytes(h)))
        f.seek(at)
        f.write(h)
    with open_store([d], kv) as s:
        assert word > ub or word == 0
        assert s.stored_blocks([91]) == [0]
        assert s.stats()["bad_headers"] == 1
        zero(kv)
        for ask in (1, 2, ub):
            assert s.retrieve([91], np.arange(ask)).failed_units == [0]
        _untouched(kv, np.arange(BLOCKS))
        _no_leak(s)


@pytest.mark.parametrize("mapped", [True, False])
def test_damage_past_the_blocks_asked_is_found_while_the_store_is_open(tmpfs, mapped):
    """A byte flipped on the live pool file (tmpfs: the store's mapping, or its io_uring reads,
    see it at once) past the blocks a retrieve asks for: in a partial unit's zero tail, or in a
    whole unit's later blocks. Every byte of the object is checked, so the unit is a miss and
    dropped; nothing damaged reaches a block that was asked for as a hit."""
    d = tmpfs("64m")
    kv = make_kv(seed=27)
    with open_store([d], kv, map_memory_paths=mapped, capacity_gb=0.004) as s:
        g = s.geometry()
        ub = s.unit_blocks
        assert s.store([101], np.arange(2)).ok and s.store([102], np.arange(ub)).ok
        slots = find_slots([d])
        for key, at_block in ((101, 3), (102, ub - 1)):
            path, at = slots[key]
            with open(path, "r+b") as f:  # layer 1, object 1 (V), inside block `at_block`
                f.seek(at + g["header_bytes"] + 3 * g["obj_bytes"] + at_block * g["block_bytes"] + 7)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x10]))
        zero(kv)
        assert s.retrieve([101], np.arange(1)).failed_units == [0]
        assert s.retrieve([102], np.arange(10, 11)).failed_units == [0]
        assert s.stored_blocks([101, 102]) == [0, 0]
        assert s.stats()["checksum_failures"] == 2
        _no_leak(s)


def _reader(dirs: list[Path], writer: TuttiStore) -> TuttiStore:
    """A read-only store on the writer's pools, from the geometry alone (open_pools)."""
    l0 = writer.layers[0]
    r = TuttiStore(TuttiConfig(paths=dirs, unit_tokens=writer.unit_tokens, capacity_gb=writer.config.capacity_gb))
    r.open_pools(num_layers=writer.num_layers, objs_per_layer=len(l0.ptrs), block_bytes=l0.block_bytes,
                 block_tokens=writer.block_tokens, dtype=l0.dtype, block_shape=l0.block_shape)
    return r


def test_a_reader_refreshes_partial_units_and_their_replicas_keep_their_size(tmp_path, where):
    """A read-only store (open_pools) on a writer's pools finds a partial unit after refresh, with
    its block count; its GPU file (read verified, header-only, into an unaligned buffer) imported
    into another instance on the same path kind keeps that count, serves it, and refuses more."""
    dirs, opts = where
    kv = make_kv(seed=28)
    with open_store(dirs, kv, **opts) as w:
        ub = w.unit_blocks
        r = _reader(dirs, w)
        try:
            assert r.stored_blocks([1, 2]) == [0, 0]
            src = np.arange(ub + 3)
            assert w.store([1, 2], src).ok
            want = snapshot(kv)
            r.refresh()
            assert r.stored_blocks([1, 2]) == [ub, 3]
            data = r.read_unit(2)
            buf = bytearray(len(data))
            assert r.read_unit_into(2, buf, verify=False) == len(data) and bytes(buf) == data
            odd = bytearray(len(data) + 1)
            assert r.read_unit_into(2, memoryview(odd)[1:]) == len(data) and bytes(odd[1:]) == data
            with pytest.raises(TuttiError):
                r.import_unit(data)  # read-only
            assert w.remove(2)
            r.refresh()
            assert r.stored_blocks([1, 2]) == [ub, 0]
            with pytest.raises(NotFound):
                r.read_unit(2)
        finally:
            r.close()
    kv2 = make_kv(seed=29)
    with open_store(dirs, kv2, instance="replica", **opts) as x:
        assert x.import_unit(data) == 2
        assert x.stored_blocks([2]) == [3]
        with pytest.raises(LayoutError, match="whole units"):
            x.scatter_unit(data, np.arange(ub))
        zero(kv2)
        assert x.retrieve([2], np.arange(20, 24)).failed_units == [0]  # 4 of a unit of 3: a miss
        _untouched(kv2, np.arange(BLOCKS))
        assert x.retrieve([2], np.arange(20, 23)).ok
        blocks_equal(want, src[ub:], kv2, np.arange(20, 23))
        # The replica's objects are the same bytes and its header the same block count (its commit
        # sequence, and so its object tags, are its own).
        again, hb, fixed = x.read_unit(2), x.geometry()["header_bytes"], header_format()[2]
        assert again[hb:] == data[hb:] and again[fixed : fixed + 8] == data[fixed : fixed + 8]
        _no_leak(x)


def _unit_data(key: int, layer: int, ub: int) -> np.ndarray:
    """The bytes a unit of `key` holds in `layer` (kv_first: [2, ub, ...]); a partial unit holds
    the leading blocks."""
    return np.random.default_rng([key, layer]).integers(0, 65535, (2, ub, BLOCK_TOKENS, HEADS, HEAD), dtype=np.uint16)


def _tail_of(key: int, ub: int) -> int:
    """Blocks a key's unit holds: requests are [4i, 4i+1, 4i+2], the last holding 1..ub blocks."""
    return ub if key % 4 != 2 else 1 + (key // 4) % ub


def _check_unit_bytes(data: bytes, key: int, g: dict, num_layers: int) -> None:
    """A GPU file read from the pool holds exactly the key's blocks, then zeros."""
    _, fields, fixed = header_format()
    koff, _ = fields["key"]
    assert int.from_bytes(data[koff : koff + 8], "little") == key
    n = int.from_bytes(data[fixed : fixed + 8], "little")
    ub, bb = g["unit_blocks"], g["block_bytes"]
    assert n == _tail_of(key, ub)
    for l in range(num_layers):
        exp = _unit_data(key, l, ub)
        for o in range(2):
            at = g["header_bytes"] + (2 * l + o) * g["obj_bytes"]
            obj = np.frombuffer(data[at : at + g["obj_bytes"]], dtype=np.uint16)
            np.testing.assert_array_equal(obj[: n * bb // 2], exp[o, :n].reshape(-1))
            assert not obj[n * bb // 2 :].any()


def _store_partial_requests(s: TuttiStore, kv: list, bases, stop=None) -> list[int]:
    ub = s.unit_blocks
    done = []
    for base in bases:
        if stop is not None and stop.is_set():
            break
        keys = [base, base + 1, base + 2]
        tail = _tail_of(base + 2, ub)
        for l in range(len(kv)):
            for u, k in enumerate(keys):
                kv[l][:, u * ub : (u + 1) * ub] = _unit_data(k, l, ub)
        assert s.store(keys, np.arange(2 * ub + tail)).ok
        done.append(base)
    return done


@pytest.mark.parametrize("mapped", [True, False])
def test_a_reader_refreshing_while_a_writer_stores_partial_units_reads_only_exact_units(tmpfs, mapped):
    """The writer stores requests with partial last units as fast as it can, evicting (the pool
    holds about 57 units); a reader on another thread refreshes and reads every unit it finds,
    verified (read_unit) or header-only (read_unit_into, verify=False: then a replica imported
    from the bytes either verifies and holds the exact blocks, or is refused)."""
    d = tmpfs("64m")
    kv = make_kv(seed=30)
    sink = make_kv(seed=31)
    with open_store([d], kv, map_memory_paths=mapped, capacity_gb=0.004) as w:
        g = w.geometry()
        r = _reader([d], w)
        x_dir = d / "replica"
        x_dir.mkdir()
        x = open_store([x_dir], sink)
        stop = threading.Event()
        seen = {"verified": 0, "unverified": 0, "refused": 0, "absent": 0}
        errors: list[BaseException] = []

        def read() -> None:
            try:
                deadline = time.monotonic() + 1.5
                while time.monotonic() < deadline:
                    r.refresh()
                    for key in r.keys()[:8]:
                        n = r.stored_blocks([key])[0]
                        assert n in (0, _tail_of(key, g["unit_blocks"]))
                        try:
                            _check_unit_bytes(r.read_unit(key), key, g, len(kv))
                            seen["verified"] += 1
                        except NotFound:
                            seen["absent"] += 1
                        buf = bytearray(g["slot_bytes"])
                        try:
                            r.read_unit_into(key, buf, verify=False)
                        except NotFound:
                            seen["absent"] += 1
                            continue
                        try:
                            x.import_unit(buf)
                        except NotFound:
                            seen["refused"] += 1  # torn under the writer: the object checksums caught it
                            continue
                        _check_unit_bytes(x.read_unit(key), key, g, len(kv))
                        x.remove(key)
                        seen["unverified"] += 1
            except BaseException as e:  # noqa: BLE001 - reported on the main thread
                errors.append(e)
            finally:
                stop.set()

        t = threading.Thread(target=read)
        t.start()
        try:
            _store_partial_requests(w, kv, range(4, 1 << 30, 4), stop)
        finally:
            stop.set()
            t.join()
            r.close()
        assert not errors, errors[0]
        assert seen["verified"] > 0 and seen["unverified"] > 0, seen
        assert w.stats()["evictions"] > 0
        _no_leak(w)
        _no_leak(x)
        x.close()


@pytest.mark.parametrize("mapped", [True, False])
def test_threads_retrieving_one_key_with_every_block_count(tmpfs, mapped):
    """Four threads retrieve the same units (whole, 3 blocks, 1 block) asking 1..unit_blocks
    blocks, each into its own blocks, while a fifth stores other units: each retrieve is exact
    when it asks at most what the unit holds and a miss that writes nothing otherwise."""
    d = tmpfs("64m")
    kv = make_kv(seed=32)
    with open_store([d], kv, map_memory_paths=mapped, capacity_gb=0.02) as s:
        ub = s.unit_blocks
        held = {201: ub, 202: 3, 203: 1}
        src = {201: np.arange(0, ub), 202: np.arange(ub, ub + 3), 203: np.arange(ub + 3, ub + 4)}
        for k, n in held.items():
            assert s.store([k], src[k]).ok
        want = snapshot(kv)
        zero(kv)
        region = 16  # thread t owns blocks [16 t, 16 t + 16); the storer owns [80, 96)

        def retrieve(t: int) -> None:
            rng = np.random.default_rng(t)
            mine = np.arange(region * t, region * (t + 1))
            for _ in range(150):
                k = int(rng.choice(list(held)))
                ask = int(rng.integers(1, ub + 1))
                dst = rng.permutation(mine)[:ask]
                for layer in kv:
                    layer[:, mine] = 0
                res = s.retrieve([k], dst)
                if ask <= held[k]:
                    assert res.ok, (k, ask, res)
                    blocks_equal(want, src[k][:ask], kv, dst)
                    _untouched(kv, np.setdiff1d(mine, dst))
                else:
                    assert res.failed_units == [0], (k, ask, res)
                    _untouched(kv, mine)

        def store() -> None:
            rng = np.random.default_rng(99)
            for i in range(60):
                ids = np.arange(80, 80 + 1 + int(rng.integers(0, 2 * ub)))
                for layer in kv:
                    layer[:, ids] = rng.integers(0, 65535, layer[:, ids].shape, dtype=np.uint16)
                n = (len(ids) + ub - 1) // ub
                assert s.store([5000 + 2 * i + j for j in range(n)], ids).ok

        run_threads(*(lambda t=t: retrieve(t) for t in range(1, 5)), store)
        assert s.stats()["evictions"] == 0 and s.stored_blocks(list(held)) == list(held.values())
        _no_leak(s)


@pytest.mark.parametrize("mapped", [True, False])
def test_racing_stores_of_one_key_with_different_block_counts(tmpfs, mapped):
    """Two threads store the same keys at once, one as a partial unit of 2 blocks from its
    blocks, the other as a whole unit from other blocks: one of them wins each key, and the
    unit then holds exactly the winner's blocks, with the winner's block count."""
    d = tmpfs("64m")
    kv = make_kv(seed=38)
    with open_store([d], kv, map_memory_paths=mapped, capacity_gb=0.02) as s:
        ub = s.unit_blocks
        want = snapshot(kv)
        go = threading.Barrier(2)
        keys = list(range(7000, 7060))

        def store(blocks) -> None:
            try:
                for k in keys:
                    go.wait()
                    assert s.store([k], blocks).ok
            except BaseException:
                go.abort()  # the other thread stops waiting
                raise

        a, b = np.arange(0, 2), np.arange(10, 10 + ub)
        run_threads(lambda: store(a), lambda: store(b))
        counts = s.stored_blocks(keys)
        assert set(counts) <= {2, ub}, counts
        for k, n in zip(keys, counts):
            zero(kv)
            assert s.retrieve([k], np.arange(40, 40 + n)).ok
            blocks_equal(want, a if n == 2 else b, kv, np.arange(40, 40 + n))
            if n < ub:
                assert s.retrieve([k], np.arange(40, 41 + n)).failed_units == [0]
        assert s.stats()["units"] == len(keys)
        _no_leak(s)


def test_threads_importing_one_partial_unit_keep_one_copy(tmp_path):
    d, e = tmp_path / "d", tmp_path / "e"
    d.mkdir()
    e.mkdir()
    kv = make_kv(seed=39)
    with open_store([d], kv) as s:
        assert s.store([1, 2], np.arange(s.unit_blocks + 1)).ok
        data = [s.read_unit(1), s.read_unit(2)]
    want = snapshot(kv)
    kv2 = make_kv(seed=40)
    with open_store([e], kv2) as x:
        def imp(t: int) -> None:
            for i in range(40):
                assert x.import_unit(data[(t + i) % 2]) in (1, 2)

        run_threads(*(lambda t=t: imp(t) for t in range(4)))
        ub = x.unit_blocks
        assert x.stored_blocks([1, 2]) == [ub, 1] and x.stats()["units"] == 2
        zero(kv2)
        assert x.retrieve([1, 2], np.arange(30, 31 + ub)).ok
        blocks_equal(want, np.arange(ub + 1), kv2, np.arange(30, 31 + ub))
        _no_leak(x)


def test_pins_hold_partial_units_through_eviction_and_misses_leave_no_pin(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=33)
    with open_store([d], kv, capacity_gb=0.0006) as s:  # 9 slots
        ub = s.unit_blocks
        total = s.stats()["total_slots"]
        assert total < 16
        assert s.store([301], np.arange(2)).ok
        want = snapshot(kv)
        s.pin([301])
        for _ in range(5):  # asking a unit for more than it holds: a miss, and its pin goes back
            assert s.retrieve([301], np.arange(3)).failed_units == [0]
        assert s.stats()["pinned"] == 1
        for i in range(3 * total):
            assert s.store([400 + i], np.arange(ub)).ok
        assert s.stored_blocks([301]) == [2] and s.stats()["evictions"] >= 2 * total
        zero(kv)
        assert s.retrieve([301], np.arange(50, 52)).ok
        blocks_equal(want, [0, 1], kv, [50, 51])
        s.unpin([301])
        for i in range(total):
            assert s.store([900 + i], np.arange(ub)).ok
        assert s.stored_blocks([301]) == [0]
        _no_leak(s)


def test_storing_a_partial_units_key_again_with_more_blocks_never_serves_zeros(tmp_path):
    """A key stored partial (2 blocks), then stored again whole: the store keeps what it holds
    (the second is skipped), so a retrieve of the whole unit is a miss, never the zero tail."""
    d = tmp_path / "d"
    d.mkdir()
    kv = make_kv(seed=34)
    with open_store([d], kv) as s:
        ub = s.unit_blocks
        assert s.store([501], np.arange(2)).ok
        res = s.store([501], np.arange(ub))
        assert res.skipped_units == 1
        zero(kv)
        assert s.retrieve([501], np.arange(40, 40 + ub)).failed_units == [0]
        _untouched(kv, np.arange(BLOCKS))
        _no_leak(s)


CRASH_WRITER = r"""
import sys
sys.path.insert(0, sys.argv[3])
import numpy as np
from conftest import BLOCK_TOKENS, make_kv
from tutti_cluster import TuttiConfig, TuttiStore
import test_partial_attack as t

kv = make_kv(seed=0)
s = TuttiStore(TuttiConfig(paths=[sys.argv[1]], capacity_gb=0.004, unit_tokens=64, staging_mb=2,
                           min_io_bytes=4096, map_memory_paths=sys.argv[2] == "1"))
s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS)
start = int(sys.argv[4])
for base in range(start, 1 << 40, 4):
    t._store_partial_requests(s, kv, [base])
    print(base, flush=True)
"""


@pytest.mark.parametrize("mode", ["disk", "tmpfs-mapped"])
def test_kill_9_mid_partial_stores_leaves_only_exact_units_of_their_size(tmp_path, tmpfs, mode):
    """A child stores requests with partial last units (evicting: the pool holds about 57 units)
    and is killed with SIGKILL at three moments; after each, a reopened store holds only units
    whose block count is theirs and whose bytes are exact, and asking one block more is a miss."""
    d = tmpfs("64m") if mode == "tmpfs-mapped" else tmp_path / "disk"
    d.mkdir(exist_ok=True)
    mapped = mode == "tmpfs-mapped"
    env = {**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = 4
    for delay in (0.0, 0.013, 0.031):
        p = subprocess.Popen([sys.executable, "-c", CRASH_WRITER, str(d), "1" if mapped else "0", str(HERE), str(start)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            last = None
            for _ in range(30):  # 30 requests stored, then a kill a moment later
                line = p.stdout.readline()
                assert line, p.stderr.read()
                last = int(line)
            time.sleep(delay)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        start = last + 1000 * 4  # the next child's keys are new
        kv = make_kv(seed=1)
        with open_store([d], kv, map_memory_paths=mapped, capacity_gb=0.004) as s:
            ub = s.unit_blocks
            keys = s.keys()
            assert len(keys) > 10
            for key in keys:
                n = _tail_of(key, ub)
                assert key % 4 != 3 and s.stored_blocks([key]) == [n], key
                zero(kv)
                assert s.retrieve([key], np.arange(10, 10 + n)).ok, key
                for l in range(len(kv)):
                    np.testing.assert_array_equal(kv[l][:, 10 : 10 + n], _unit_data(key, l, ub)[:, :n])
                _untouched(kv, np.setdiff1d(np.arange(BLOCKS), np.arange(10, 10 + n)))
                if n < ub:
                    assert s.retrieve([key], np.arange(10, 11 + n)).failed_units == [0]
            _no_leak(s)


# ==== deferred writes: the vLLM connector ==========================================================
def _vllm():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    import test_vllm_connector as tv

    return tv


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _name_key(c, name: bytes) -> int:
    from tutti_cluster.vllm import _key

    return _key(c.worker.prefix, name.ljust(32, b"."))


def _drain(tv, c) -> None:
    tv._drain(c, limit_s=20.0)


@pytest.mark.vllm
@pytest.mark.parametrize("limit,slow", [({"iocb_depth": 3}, True), ({"max_requests": 1}, True),
                                        ({"max_requests": 1}, False)])
def test_a_load_is_not_failed_by_writes_that_run_on(tmp_path, monkeypatch, limit, slow):
    """Room for one request at a time (2 layers and iocb_depth 3, or max_requests 1). A write of
    the previous step still runs (held so by an injected `done` that says False, a slow device;
    or, `slow` False, no fault at all: the step's writes are rarely done when it ends) when the
    next step loads a unit that is stored. The docs: "A begin that finds the IOCB table or slots
    full finishes the running writes first and tries once more"; with defer_saves off it loads."""
    # Regression (once failed): TuttiWorker._begin retried only stores, so a load met
    # CapacityExceeded and its blocks were reported as load errors (under vLLM's default
    # kv_load_failure_policy 'fail', a failed user request).
    tv = _vllm()
    c, kv = tv._worker(tmp_path, **limit)
    try:
        store = c.worker.store
        tv._step(c, saves=[tv._unit(c, b"b", [2, 3])])
        _drain(tv, c)
        if slow:
            monkeypatch.setattr(store, "done", lambda req: False)  # injected fault: writes "still run"
        tv._step(c, saves=[tv._unit(c, b"a", [0, 1])])
        if not tv._in_flight(c):
            pytest.skip("the write was done within its step on this machine: nothing runs on")
        want = {n: t.clone() for n, t in kv.items()}
        for t in kv.values():
            t[8:10] = 0
        tv._step(c, loads=[tv._unit(c, b"b", [8, 9])])
        assert not c.get_block_ids_with_load_errors()
        for n, t in kv.items():
            assert torch_equal(t[8:10], want[n][2:4])
    finally:
        c.shutdown()


@pytest.mark.vllm
def test_a_save_that_finds_every_slot_held_by_running_writes_is_dropped_safely(tmp_path, monkeypatch):
    """A pool of two slots, both reserved by the writes of a step that run on (injected `done`:
    a slow device). The next step's save finds no slot: as ARCHITECTURE.md says, that unit is not
    stored (a later miss), nothing leaks, the running writes still commit, and the same save in a
    later step, with those units committed and evictable, is stored."""
    tv = _vllm()
    c, kv = tv._worker(tmp_path, capacity_gb=0.00004)
    try:
        store = c.worker.store
        assert store.stats()["total_slots"] == 2
        monkeypatch.setattr(store, "done", lambda req: False)  # injected fault: writes "still run"
        tv._step(c, saves=[tv._unit(c, b"a", [0, 1]), tv._unit(c, b"b", [2, 3])])
        assert tv._in_flight(c) == {"a", "b"} and store.stats()["free_slots"] == 0
        tv._step(c, saves=[tv._unit(c, b"c", [4, 5])])
        monkeypatch.undo()
        _drain(tv, c)
        stats = c.get_kv_connector_stats().reduce()
        assert stats["store_failed_units"] == 1 and stats["store_units"] == 2, stats
        assert store.lookup([_name_key(c, b"a")]) == 1 and store.lookup([_name_key(c, b"b")]) == 1
        assert store.lookup([_name_key(c, b"c")]) == 0
        tv._step(c, saves=[tv._unit(c, b"c", [4, 5])])
        _drain(tv, c)
        assert store.lookup([_name_key(c, b"c")]) == 1
        tv._no_request_left(c)
    finally:
        c.shutdown()


@pytest.mark.vllm
def test_a_store_that_finds_the_iocb_table_full_settles_the_writes_and_retries(tmp_path, monkeypatch):
    tv = _vllm()
    c, kv = tv._worker(tmp_path, iocb_depth=3)
    try:
        store = c.worker.store
        monkeypatch.setattr(store, "done", lambda req: False)  # injected fault: writes "still run"
        tv._step(c, saves=[tv._unit(c, b"a", [0, 1])])
        tv._step(c, saves=[tv._unit(c, b"b", [2, 3])])  # a is finished first, then b begins
        assert store.lookup([_name_key(c, b"a")]) == 1
        assert tv._in_flight(c) == {"b"}
        monkeypatch.undo()
        _drain(tv, c)
        assert store.lookup([_name_key(c, b"a"), _name_key(c, b"b")]) == 2
        want = {n: t.clone() for n, t in kv.items()}
        for t in kv.values():
            t[8:12] = 0
        tv._step(c, loads=[tv._unit(c, b"a", [8, 9])])
        tv._step(c, loads=[tv._unit(c, b"b", [10, 11])])
        assert not c.get_block_ids_with_load_errors()
        for n, t in kv.items():
            assert torch_equal(t[8:12], want[n][0:4])
        tv._no_request_left(c)
    finally:
        c.shutdown()


@pytest.mark.vllm
def test_shutdown_with_writes_running_commits_them_and_hangs_not(tmp_path, monkeypatch):
    tv = _vllm()
    c, kv = tv._worker(tmp_path)
    store = c.worker.store
    monkeypatch.setattr(store, "done", lambda req: False)  # injected fault: never reported done
    tv._step(c, saves=[tv._unit(c, b"a", [0, 1]), tv._unit(c, b"b", [2, 3])])
    tv._step(c, saves=[tv._unit(c, b"p", [4])])  # a partial unit (1 of 2 blocks)
    assert tv._in_flight(c) == {"a", "b", "p"}
    want = {n: t.clone() for n, t in kv.items()}
    from tutti_cluster.vllm import TuttiConnectorMetadata

    # A step cut short: its save begun and its first layer issued, no wait_for_save.
    c.bind_connector_metadata(TuttiConnectorMetadata(saves=[tv._unit(c, b"cut", [6, 7])]))
    c.start_load_kv(None)
    c.save_kv_layer(tv.LAYER_NAMES[0], None, None)
    t0 = time.monotonic()
    c.shutdown()
    c.shutdown()  # twice: nothing left to do
    assert time.monotonic() - t0 < 10
    again, kv2 = tv._worker(tmp_path)
    try:
        s = again.worker.store
        keys = [_name_key(again, n) for n in (b"a", b"b", b"p", b"cut")]
        assert s.stored_blocks(keys) == [2, 2, 1, 0] and s.stats()["bad_headers"] == 0
        for t in kv2.values():
            t[8:11] = 0
        tv._step(again, loads=[tv._unit(again, b"a", [8, 9]), tv._unit(again, b"p", [10])])
        assert not again.get_block_ids_with_load_errors()
        for n, t in kv2.items():
            assert torch_equal(t[8:10], want[n][0:2]) and torch_equal(t[10], want[n][4])
        tv._step(again, loads=[tv._unit(again, b"p", [12, 13])])  # 2 blocks of a unit of 1: a miss
        assert again.get_block_ids_with_load_errors() == {12, 13}
        tv._no_request_left(again)
    finally:
        again.shutdown()


@pytest.mark.vllm
def test_finish_transfers_odd_and_repeated_and_unknown_preemptions(tmp_path, monkeypatch):
    """A finish for a request that never saved is reported at once; one repeated (in one step and
    over steps) is reported once while its writes run and once more never; preempted ids the
    worker never saw change nothing; a preemption completes only that request's writes."""
    tv = _vllm()
    from tutti_cluster.vllm import TuttiConnectorMetadata, _Transfer

    c, kv = tv._worker(tmp_path)
    try:
        store = c.worker.store
        tv._step(c, saves=[_Transfer("ghost", [], [], finish=True)])
        sent, _ = c.get_finished(set())
        assert sent == {"ghost"}
        monkeypatch.setattr(store, "done", lambda req: False)  # injected fault: writes "still run"
        tv._step(c, saves=[tv._unit(c, b"a", [0, 1]), tv._unit(c, b"b", [2, 3])])
        fin = _Transfer("a", [], [], finish=True)
        tv._step(c, saves=[fin, fin])
        tv._step(c, saves=[fin])
        sent, _ = c.get_finished(set())
        assert not sent and tv._in_flight(c) == {"a", "b"}
        c.bind_connector_metadata(TuttiConnectorMetadata(preempted=["nobody", "ghost"]))
        c.clear_connector_metadata()
        assert tv._in_flight(c) == {"a", "b"}
        c.bind_connector_metadata(TuttiConnectorMetadata(preempted=["a", "a"]))
        c.clear_connector_metadata()
        assert tv._in_flight(c) == {"b"}
        assert store.lookup([_name_key(c, b"a")]) == 1
        tv._step(c)
        sent, _ = c.get_finished(set())
        assert sent == {"a"}
        monkeypatch.undo()
        _drain(tv, c)
        for _ in range(3):
            tv._step(c)
            sent, _ = c.get_finished(set())
            assert not sent
        tv._no_request_left(c)
        _no_leak(store)
    finally:
        c.shutdown()

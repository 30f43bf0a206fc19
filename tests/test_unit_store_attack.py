"""Adversarial tests of the unit store surface: UnitStore.open / open_pools, register_host,
scatter_unit through Backend::scatter_from_host, import_unit through UnitStore::commit_unit,
calls after close and concurrent with it, and a SIGKILL crash test with imports.

Tests commented "Regression (once failed)" reproduce a bug that was fixed; the others guard
behaviour that holds today."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BLOCK_TOKENS, UNIT_TOKENS, make_kv, open_store, run_threads, snapshot, zero
from tutti_cluster import TuttiConfig, TuttiStore, _native
from tutti_cluster.config import native_options
from tutti_cluster.errors import LayoutError, NotFound, TuttiError

HERE = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

# The geometry make_kv's default ("kv_first") layers register as.
NUM_LAYERS, OBJS, BLOCK_BYTES, DTYPE, BLOCK_SHAPE = 4, 2, 2048, "uint16", (16, 2, 32)


def cfg(d: Path, **kw) -> TuttiConfig:
    c = dict(paths=[d], capacity_gb=0.02, unit_tokens=UNIT_TOKENS, staging_mb=2, min_io_bytes=4096)
    c.update(kw)
    return TuttiConfig(**c)


def reader(d: Path, **geom) -> TuttiStore:
    g = dict(num_layers=NUM_LAYERS, objs_per_layer=OBJS, block_bytes=BLOCK_BYTES, block_tokens=BLOCK_TOKENS,
             dtype=DTYPE, block_shape=BLOCK_SHAPE)
    g.update(geom)
    r = TuttiStore(cfg(d))
    r.open_pools(**g)
    return r


def run_py(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=HERE, env=ENV)


@pytest.fixture
def stored(tmp_path):
    """A writer store on its own path holding units 7 and 8; yields (store, kv, path, unit 7's bytes)."""
    d = tmp_path / "w"
    d.mkdir()
    kv = make_kv(seed=3)
    s = open_store([d], kv)
    ub = s.unit_blocks
    assert s.store([7, 8], np.arange(2 * ub)).ok
    yield s, kv, d, s.read_unit(7)
    s.close()


# ---- UnitStore.open / open_pools: geometry and desc ------------------------------------------------

@pytest.mark.parametrize("num_layers,objs,block_bytes,desc", [
    (0, 2, 2048, "x"), (4, 0, 2048, "x"), (4, 3, 2048, "x"), (4, 2, 0, "x"), (4, 2, 3, "x"), (4, 2, 2 ** 40, "x"),
    (4, 2, 2048, "x" * 96), (4, 2, 2048, "\u00e9" * 48),  # 96 bytes of UTF-8
])
def test_unit_store_open_rejects_bad_geometry(tmp_path, num_layers, objs, block_bytes, desc):
    o = native_options(cfg(tmp_path), backend="cpu", unit_blocks=4, read_only=False)
    with pytest.raises(LayoutError):
        _native.UnitStore.open(o, num_layers, objs, block_bytes, desc)
    assert not list(tmp_path.glob("*.pool"))


@pytest.mark.parametrize("bad", [-1, 2 ** 32, 2 ** 64, 1.5, "4"])
def test_unit_store_open_rejects_non_u32_sizes(tmp_path, bad):
    o = native_options(cfg(tmp_path), backend="cpu", unit_blocks=4, read_only=True)
    with pytest.raises((TypeError, TuttiError)):
        _native.UnitStore.open(o, bad, 2, 2048, "x")


def test_open_pools_with_another_geometry_is_refused_and_the_right_one_is_byte_exact(stored):
    w, kv, d, data = stored
    for geom in (dict(num_layers=3), dict(block_bytes=4096), dict(objs_per_layer=1), dict(dtype="float16"),
                 dict(block_shape=(16, 2, 33)), dict(num_layers=2 ** 31 + 2)):
        with pytest.raises(LayoutError):
            reader(d, **geom)
    r = reader(d)
    try:
        assert sorted(r.keys()) == [7, 8]
        assert r.read_unit(7) == data
        assert r.geometry() == w.geometry()
        # a second open_pools on the same object is refused; the first stays usable
        with pytest.raises(TuttiError):
            r.open_pools(num_layers=3, objs_per_layer=2, block_bytes=2048, block_tokens=16)
        assert r.read_unit(7) == data
    finally:
        r.close()
    with pytest.raises(TuttiError):
        TuttiStore(cfg(d.parent / "nowhere")).open_pools(num_layers=4, objs_per_layer=2, block_bytes=2048,
                                                         block_tokens=16)


# Regression (once failed): make_geometry: Geometry::num_objs() is num_layers * objs_per_layer
# in uint32 arithmetic and wraps; open_pools(num_layers=2**31+1, objs_per_layer=2) opens with a
# 2-object slot (slot_bytes 20480) while geometry() reports 2147483649 layers, instead of raising
# LayoutError
def test_open_pools_num_objs_overflow_is_rejected(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    open_store([d], make_kv()).close()  # an empty pool of this instance
    r = TuttiStore(cfg(d))
    try:
        r.open_pools(num_layers=2 ** 31 + 1, objs_per_layer=2, block_bytes=2048, block_tokens=16)
    except LayoutError:
        return
    g = r.geometry()
    r.close()
    assert g["slot_bytes"] >= g["num_layers"] * g["objs_per_layer"] * g["obj_bytes"], g


# Regression (once failed): make_geometry accepts any num_layers: open_pools(num_layers=2**28,
# objs_per_layer=2) makes a 4 GiB header (slot_bytes 4.4 TB, 0 slots in any pool) and
# UnitStore::recover then allocates and zeroes it (16 s, 8 GiB RSS unlimited; under a 2 GiB
# RLIMIT_AS it is CapacityExceeded 'out of memory') instead of a prompt LayoutError
def test_open_pools_absurd_header_is_rejected_before_allocating(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    open_store([d], make_kv()).close()
    r = run_py(f"""
        import os, resource, sys
        if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # ASan reserves terabytes of address space
            resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from test_unit_store_attack import cfg
        from tutti_cluster import TuttiStore
        from tutti_cluster.errors import LayoutError, ConfigError
        s = TuttiStore(cfg({str(d)!r}))
        try:
            s.open_pools(num_layers=2 ** 28, objs_per_layer=2, block_bytes=2048, block_tokens=16)
        except (LayoutError, ConfigError) as e:
            print("REJECTED", e)
            sys.exit(0)
        except Exception as e:
            print("OTHER", type(e).__name__, e)
            sys.exit(3)
        print("OPENED", s.geometry())
        sys.exit(4)
    """)
    assert r.returncode == 0, r.stdout + r.stderr


# Regression (once failed): module.cc raise(): PyErr_SetString needs UTF-8, so a Status message
# holding the desc's bytes (UnitStore.open(o, 4, 2, 2048, b'\xff\xfe') on a pool with units:
# 'holds units of another layout ... this store is \xff\xfe') surfaces as UnicodeDecodeError, not
# LayoutError/TuttiError
def test_unit_store_open_non_utf8_desc_raises_tutti_error(stored):
    w, kv, d, data = stored
    o = native_options(cfg(d), backend="cpu", unit_blocks=4, read_only=True)
    with pytest.raises(TuttiError):
        _native.UnitStore.open(o, 4, 2, 2048, b"\xff\xfe")


def test_read_only_store_engine_calls_raise_tutti_error(stored):
    w, kv, d, data = stored
    r = reader(d)
    ub = r.unit_blocks
    calls = [
        lambda: r.begin_store([1], np.arange(ub)), lambda: r.begin_retrieve([7], np.arange(ub)),
        lambda: r.store([1], np.arange(ub)), lambda: r.retrieve([7], np.arange(ub)),
        lambda: r.scatter_unit(data, np.arange(ub)), lambda: r.register_host(bytearray(64)),
        lambda: r.scatter_unit_async(data, np.arange(ub)), lambda: r.scatter_wait(1),
        lambda: r.get_iocb(1), lambda: r.fill_iocb(0, op="read", layer=0, req=0, first=0, count=1),
        lambda: r.issue_io([0]), lambda: r.wait_cqe(0), lambda: r.put_iocb(0), lambda: r.compute_stream(),
        lambda: r.finish(0), lambda: r.wait_layer(0, 0), lambda: r.store_layer(0, 0), lambda: r.retrieve_layer(0, 0),
        lambda: r._e,
    ]
    try:
        for i, c in enumerate(calls):
            with pytest.raises(TuttiError):
                c()
        r.unregister_host(12345)  # nothing registered: nothing
        assert r.read_unit(7) == data and r.lookup([7, 8]) == 2
        r.refresh()
        assert r.read_unit(7) == data
    finally:
        r.close()
    for c in calls + [lambda: r.lookup([7]), lambda: r.read_unit(7), lambda: r.refresh(), lambda: r.stats()]:
        with pytest.raises(TuttiError):
            c()


def _full_reader(tmp_path):
    d, src = tmp_path / "full", tmp_path / "src"
    d.mkdir()
    src.mkdir()
    with open_store([src], make_kv(seed=1)) as a:
        ub = a.unit_blocks
        assert a.store([500], np.arange(ub)).ok
        extra = a.read_unit(500)
        slot = len(extra)
    with open_store([d], make_kv(seed=2), capacity_gb=3.5 * slot / (1 << 30), pool_files=1) as w:
        assert w.stats()["total_slots"] == 3
        assert w.store([1, 2, 3], np.arange(3 * ub)).ok
    return reader(d), extra


# Regression (once failed): UnitStore::import_unit on a read-only store (open_pools) with no
# free slot: alloc_slot evicts the LRU unit from the reader's index (and queues it in
# drain_evicted) before the pwrite fails with EBADF; the StorageError leaves unit 1 unlisted
# though it is intact on disk, and its slot neither free nor used
def test_import_into_full_read_only_store_keeps_its_index(tmp_path):
    r, extra = _full_reader(tmp_path)
    try:
        assert sorted(r.keys()) == [1, 2, 3]
        with pytest.raises(TuttiError):
            r.import_unit(extra)
        st_ = r.stats()
        assert sorted(r.keys()) == [1, 2, 3] and r.lookup([1]) == 1
        assert st_["units"] + st_["free_slots"] == st_["total_slots"]
        assert r._n.drain_evicted() == []
    finally:
        r.close()


# Regression (once failed): UnitStore::remove on a read-only store (open_pools, as the node
# daemon's 'remove' command uses it) returns True and drops the key from the reader's index, while
# free_slot's invalidate fails silently (EBADF) so the unit stays committed on disk: the remove is
# reported done but nothing was removed
def test_remove_on_read_only_store_is_refused(tmp_path):
    r, extra = _full_reader(tmp_path)
    try:
        try:
            gone = r.remove(1)
        except TuttiError:
            gone = None
        r.refresh()
        assert gone is None or r.lookup([1]) == 0, "reported removed, yet the pool still holds it"
    finally:
        r.close()


# ---- buffers: strides, read-only, zero length, register_host ------------------------------------------

# Regression (once failed): module.cc scatter_unit: py::buffer::request() accepts strided
# buffers and the bytes are read as i.size*itemsize contiguous bytes from i.ptr;
# scatter_unit(np_bytes[::2]) whose logical content is not a unit succeeds, scattering the
# contiguous memory under it
def test_scatter_unit_from_strided_buffer_is_refused(stored):
    s, kv, d, data = stored
    ub = s.unit_blocks
    n = len(data)
    arr = np.zeros(2 * n, np.uint8)
    arr[:n] = np.frombuffer(data, np.uint8)
    view = arr[::2]
    assert bytes(view) != data
    with pytest.raises((TuttiError, BufferError, ValueError)):
        s.scatter_unit(view, np.arange(ub) + 40)


# Regression (once failed): module.cc import_unit: a strided buffer is read as contiguous
# memory; import_unit(np_bytes[::2]) whose logical bytes are no unit commits the unit lying
# contiguously under it
def test_import_unit_from_strided_buffer_is_refused(stored):
    s, kv, d, data = stored
    n = len(data)
    assert s.remove(7)
    arr = np.zeros(2 * n, np.uint8)
    arr[:n] = np.frombuffer(data, np.uint8)
    with pytest.raises((TuttiError, BufferError, ValueError)):
        s.import_unit(arr[::2])
    assert s.lookup([7]) == 0


# Regression (once failed): module.cc read_unit_into: request(true) accepts a strided writable
# buffer and the unit is written as slot_bytes contiguous bytes from its first element; the call
# returns slot_bytes with the view's logical content not the unit (with a [::-1] view it writes
# past the buffer: see the next test)
def test_read_unit_into_strided_buffer_is_refused_or_exact(stored):
    s, kv, d, data = stored
    backing = bytearray(2 * len(data))
    view = memoryview(backing)[::2]
    try:
        s.read_unit_into(7, view)
    except (TuttiError, BufferError, ValueError):
        return
    assert bytes(view) == data


# Regression (once failed): module.cc read_unit_into with memoryview(mmap(slot_bytes))[::-1]:
# i.ptr is the buffer's last byte and slot_bytes bytes are written from there, slot_bytes-1 bytes
# past the mapping: heap/mapping overflow, the process dies with SIGSEGV
def test_read_unit_into_reversed_view_does_not_overflow(stored):
    s, kv, d, data = stored
    r = run_py(f"""
        import mmap
        from test_unit_store_attack import reader
        r = reader(__import__("pathlib").Path({str(d)!r}))
        n = r.geometry()["slot_bytes"]
        m = mmap.mmap(-1, n)
        v = memoryview(m)[::-1]
        try:
            r.read_unit_into(7, v)
        except Exception as e:
            print("REFUSED", type(e).__name__)
            raise SystemExit(0)
        want = r.read_unit(7)
        print("EXACT" if bytes(v) == want else "WRONG", flush=True)
        raise SystemExit(0 if bytes(v) == want else 5)
    """)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])


# Regression (once failed): module.cc crc32c: a strided buffer is summed as contiguous memory
# (crc32c(a[::2]) != crc32c(bytes(a[::2]))); with a [::-1] view it reads past the buffer
def test_crc32c_of_strided_buffer(stored):
    a = np.arange(4096, dtype=np.uint8)
    assert _native.crc32c(a[::2]) == _native.crc32c(bytes(a[::2]))


def test_read_unit_into_read_only_or_small_buffer_is_refused(stored):
    s, kv, d, data = stored
    with pytest.raises((TuttiError, BufferError)):
        s.read_unit_into(7, bytes(len(data)))
    with pytest.raises(TuttiError):
        s.read_unit_into(7, bytearray(len(data) - 1))
    with pytest.raises(NotFound):
        s.read_unit_into(12345, bytearray(len(data)))
    buf = np.zeros(len(data) // 4 + 3, np.uint32)  # larger, other item size
    assert s.read_unit_into(7, buf) == len(data)
    assert buf.tobytes()[: len(data)] == data


def test_register_host_edge_cases(stored):
    s, kv, d, data = stored
    ub = s.unit_blocks
    for empty in (bytearray(), b"", memoryview(bytearray(10))[5:5], np.zeros(0, np.uint8)):
        with pytest.raises(TuttiError):
            s.register_host(empty)
    with pytest.raises(TypeError):
        s.register_host(5)
    ro = bytes(data)
    addr_ro = s.register_host(ro)  # read-only memory may be registered: scatter only reads it
    s.scatter_unit(ro, np.arange(ub) + 20)
    arena = bytearray(data) + bytearray(data)
    a1 = s.register_host(arena)
    a2 = s.register_host(memoryview(arena)[len(data):])  # a slice of the same buffer
    with pytest.raises(TuttiError, match="registered already"):
        s.register_host(arena)  # the same address twice: refused (one unregister undoes one register)
    assert a2 == a1 + len(data)
    with pytest.raises(BufferError):
        arena.extend(b"x")
    want = snapshot(kv)
    s.scatter_unit(memoryview(arena)[len(data):], np.arange(ub) + 30)
    for l in range(len(kv)):
        np.testing.assert_array_equal(kv[l][:, 30:30 + ub], want[l][:, :ub])
    for junk in (0, 1, 12345, 2 ** 63, 2 ** 64 - 1, -1, 2 ** 70):
        s.unregister_host(junk)
    s.unregister_host(a1)
    s.unregister_host(a1)
    with pytest.raises(BufferError):
        arena.extend(b"x")  # the slice is still registered
    s.unregister_host(a2)
    arena.extend(b"x")
    del arena[-1:]
    b = s.register_host(arena)
    s.unregister_host(addr_ro)
    s.close()
    arena.extend(b"x")  # close released it
    s.unregister_host(b)  # after close: nothing
    with pytest.raises(TuttiError):
        s.register_host(arena)
    with pytest.raises(TuttiError):
        s.scatter_unit(data, np.arange(ub))


# ---- scatter_unit: bad data and block ids ---------------------------------------------------------------

def _kv_unchanged(kv, before):
    for a, b in zip(kv, before):
        np.testing.assert_array_equal(a, b)


def test_scatter_unit_bad_block_ids_are_refused_and_touch_nothing(stored):
    s, kv, d, data = stored
    ub = s.unit_blocks
    nb = kv[0].shape[1]
    bad = [np.arange(ub, dtype=float), np.arange(ub).reshape(2, -1), -np.arange(1, ub + 1), np.arange(ub) + nb - 1,
           np.full(ub, 2 ** 63 - 1), np.full(ub, 2 ** 64 - 1, np.uint64), np.full(ub, 2 ** 32 + 1, np.int64),
           np.arange(ub - 1), np.arange(ub + 1), [], np.ones(ub, bool), np.array([1, 2, 3, 2 ** 80], dtype=object),
           "abcd", np.array([0, 1, -2 ** 63, 3])]
    before = snapshot(kv)
    for i, b in enumerate(bad):
        with pytest.raises(TuttiError):
            s.scatter_unit(data, b)
        if i == 7:  # ub - 1 blocks: a partial unit, which a store takes (test_partial_units.py)
            continue
        with pytest.raises(TuttiError):
            s.begin_store([999], b)
    _kv_unchanged(kv, before)
    assert s.lookup([999]) == 0
    for wrong in (data[:-1], data + b"\0", b"", data[:4096], data[:-4096], data * 2):
        with pytest.raises(TuttiError):
            s.scatter_unit(wrong, np.arange(ub) + 40)
        with pytest.raises(TuttiError):
            s.import_unit(wrong)
    _kv_unchanged(kv, before)


def test_scatter_unit_block_id_forms(stored):
    s, kv, d, data = stored
    ub = s.unit_blocks
    want = snapshot(kv)
    ids = [np.arange(ub, dtype=np.int8) + 40, list(range(50, 50 + ub)), np.arange(2 * ub)[::2] + 60,
           np.array([80, 70, 90, 71])[:ub], np.arange(ub, dtype=np.uint32) + 20]
    for b in ids:
        zero(kv)
        s.scatter_unit(data, b)
        b = np.asarray(b)
        for l in range(len(kv)):
            for j in range(ub):
                np.testing.assert_array_equal(kv[l][:, int(b[j])], want[l][:, j])
    # duplicate ids: refused (a block written from two places could be left torn), nothing written
    zero(kv)
    with pytest.raises(LayoutError, match="appears twice"):
        s.scatter_unit(data, np.array([33] * (ub - 1) + [34]))
    assert all(not layer.any() for layer in kv)


def test_scatter_unit_of_another_layout_is_not_found(stored, tmp_path):
    s, kv, d, data = stored
    ub = s.unit_blocks
    o = tmp_path / "o"
    o.mkdir()
    kv2 = [l.view(np.int16) for l in make_kv(seed=5)]  # same sizes, another dtype: another layout
    with open_store([o], kv2) as b:
        assert b.geometry()["slot_bytes"] == len(data)
        assert b.store([7], np.arange(ub)).ok
        other = b.read_unit(7)
        with pytest.raises(NotFound):
            b.scatter_unit(data, np.arange(ub) + 10)
        with pytest.raises(NotFound):
            b.import_unit(data)
    with pytest.raises(NotFound):
        s.scatter_unit(other, np.arange(ub) + 10)
    assert s.remove(7)
    with pytest.raises(NotFound):
        s.import_unit(other)
    assert s.lookup([7]) == 0


# ---- import_unit: corruption and round trips -------------------------------------------------------------

HEADER_LIST = 168 + 8 + 8 * NUM_LAYERS * OBJS  # HeaderFixed, the block word and the object checksum list: what the header CRC covers


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_import_of_corrupted_unit_is_not_found_and_not_held(stored, data):
    s, kv, d, unit = stored
    g = s.geometry()
    s.remove(7)
    region = data.draw(st.sampled_from(["header", "objects"]))
    lo, hi = (0, HEADER_LIST) if region == "header" else (g["header_bytes"], len(unit))
    bits = data.draw(st.lists(st.integers(lo * 8, hi * 8 - 1), min_size=1, max_size=3, unique=True))
    bad = bytearray(unit)
    for b in bits:
        bad[b // 8] ^= 1 << (b % 8)
    with pytest.raises(NotFound):
        s.import_unit(bad)
    assert s.lookup([7]) == 0 and 7 not in s.keys()
    with pytest.raises(NotFound):
        s.read_unit(7)
    before = snapshot(kv)
    with pytest.raises(NotFound):
        s.scatter_unit(bytes(bad), np.arange(s.unit_blocks) + 40)
    if region == "header":  # refused before any block is written
        _kv_unchanged(kv, before)


def test_import_ignores_header_padding_but_round_trips_the_payload(stored, tmp_path):
    """Bytes of the header slot beyond the checksummed list carry nothing: a flip there is accepted,
    and what is stored and read back is still the original payload, byte for byte."""
    s, kv, d, unit = stored
    g = s.geometry()
    hb = g["header_bytes"]
    bad = bytearray(unit)
    bad[hb - 1] ^= 0x80
    bad[HEADER_LIST] ^= 0x01
    o = tmp_path / "o"
    o.mkdir()
    kv2 = make_kv(seed=9)
    with open_store([o], kv2) as b:
        assert b.import_unit(bad) == 7
        again = b.read_unit(7)
        assert again[hb:] == unit[hb:]
        assert again[HEADER_LIST:hb] == bytes(hb - HEADER_LIST)
        zero(kv2)
        assert b.retrieve([7], np.arange(b.unit_blocks) + 8).ok
        for l in range(len(kv)):
            np.testing.assert_array_equal(kv2[l][:, 8:8 + b.unit_blocks], kv[l][:, :b.unit_blocks])


def test_import_then_store_retrieve_and_reopen_are_byte_exact(stored, tmp_path):
    s, kv, d, unit = stored
    ub = s.unit_blocks
    units = {7: unit, 8: s.read_unit(8)}
    want = snapshot(kv)
    o = tmp_path / "o"
    o.mkdir()
    kv2 = make_kv(seed=21)
    with open_store([o], kv2, capacity_gb=0.01) as b:
        for k, u in units.items():
            assert b.import_unit(u) == k
            assert b.import_unit(u) == k  # again: present, nothing written
        assert b.store([7, 8, 9], np.arange(3 * ub) + 12).committed_units == [2]  # 7, 8 already held
        zero(kv2)
        assert b.retrieve([7, 8], np.arange(2 * ub)).ok
        for l in range(len(kv)):
            np.testing.assert_array_equal(kv2[l][:, : 2 * ub], want[l][:, : 2 * ub])
        for k, u in units.items():
            got = b.read_unit(k)
            assert got[g0(b):] == u[g0(b):]
        b.scatter_unit(b.read_unit(8), np.arange(ub) + 60)
        for l in range(len(kv)):
            np.testing.assert_array_equal(kv2[l][:, 60:60 + ub], want[l][:, ub:2 * ub])
    r = reader(o)
    try:
        assert sorted(r.keys()) == [7, 8, 9]
        for k, u in units.items():
            assert r.read_unit(k)[g0(r):] == u[g0(r):]
    finally:
        r.close()


def g0(s: TuttiStore) -> int:
    return s.geometry()["header_bytes"]


def test_evicting_import_keeps_every_survivor_exact(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    kv = make_kv(seed=4)
    src = tmp_path / "src"
    src.mkdir()
    with open_store([src], kv, capacity_gb=0.01) as a:
        ub = a.unit_blocks
        n = 20
        units = {}
        for i in range(0, n, 4):
            ks = list(range(100 + i, 104 + i))
            for l in range(len(kv)):
                kv[l][:, : 4 * ub] = np.random.default_rng(i + l).integers(0, 65535, kv[l][:, : 4 * ub].shape)
            assert a.store(ks, np.arange(4 * ub)).ok
            units.update({k: a.read_unit(k) for k in ks})
    slot = len(next(iter(units.values())))
    cap_gb = 6.5 * slot / (1 << 30)  # six slots
    kv2 = make_kv(seed=6)
    with open_store([d], kv2, capacity_gb=cap_gb, pool_files=1) as b:
        assert b.stats()["total_slots"] == 6
        for k, u in units.items():
            assert b.import_unit(u) == k
        held = b.keys()
        assert len(held) == 6 and b.stats()["evictions"] == len(units) - 6
        hb = g0(b)
        for k in held:
            assert b.read_unit(k)[hb:] == units[k][hb:]


# ---- concurrency and close -----------------------------------------------------------------------------

def test_concurrent_scatter_and_import_are_exact(stored):
    s, kv, d, unit = stored
    ub = s.unit_blocks
    u8 = s.read_unit(8)
    want = snapshot(kv)

    def work(i):
        for _ in range(30):
            s.scatter_unit(unit if i % 2 else u8, np.arange(ub) + 20 + ub * i)
            s.import_unit(unit)

    run_threads(*(lambda i=i: work(i) for i in range(4)))
    for i in range(4):
        src = 0 if i % 2 else ub
        for l in range(len(kv)):
            np.testing.assert_array_equal(kv[l][:, 20 + ub * i:20 + ub * (i + 1)], want[l][:, src:src + ub])


_IN_FLIGHT = """
    import hashlib, pathlib, sys, tempfile, threading, time
    import numpy as np
    from tutti_cluster import TuttiConfig, TuttiStore
    from tutti_cluster.errors import TuttiError
    d = pathlib.Path(tempfile.mkdtemp(dir={tmp!r}))
    L, H, D = 8, 8, 2048  # 512 KiB blocks, 16 per unit: 8 MiB objects, a 128 MiB unit
    kv = [np.ones((2, 16, 16, H, D), np.uint16) for _ in range(L)]
    cfg = TuttiConfig(paths=[d], capacity_gb=0.3, unit_tokens=256, staging_mb=32, min_io_bytes=4096,
                      prewrite_pool=False)
    s = TuttiStore(cfg)
    s.register_kv_caches(kv, block_tokens=16)
    assert s.store([7], np.arange(16)).ok
    data = s.read_unit(7)
    want = hashlib.sha256(data).hexdigest()
    mode = {mode!r}
    if mode == "read":
        s.close()
        s = TuttiStore(cfg)
        s.open_pools(num_layers=L, objs_per_layer=2, block_bytes=16 * H * D * 2, block_tokens=16,
                     dtype="uint16", block_shape=(16, H, D))
        call = lambda: hashlib.sha256(s.read_unit(7)).hexdigest() == want
    else:
        s.remove(7)
        call = lambda: s.import_unit(data) == 7
    entered = threading.Event()
    outcome = []
    def worker():
        entered.set()
        try:
            outcome.append("OK" if call() else "WRONG")
        except TuttiError as e:
            outcome.append("CLOSED" if "closed" in str(e) else "BAD " + repr(e))
    t = threading.Thread(target=worker)
    t.start()
    entered.wait()
    time.sleep(0.02)
    s.close()
    print("INFLIGHT" if t.is_alive() else "JOINED", flush=True)
    t.join()
    print("OUTCOME", outcome[0], flush=True)
"""


# Regression (once failed): module.cc: every GIL-released call holds a bare UnitStore&/Store&
# while close() resets the unique_ptr (also GIL-released) without waiting: close() returns while
# import_unit/read_unit of another thread is still running on the freed store (use after free;
# import_unit then segfaults, read_unit on an open_pools reader fails with NotFound 'unit not in
# store' read from the freed index)
@pytest.mark.parametrize("mode", ["import", "read"])
def test_close_waits_for_calls_in_flight(tmp_path, mode):
    """close() from one thread while another is inside a native call: the call must finish on a live
    store (its result exact) or fail saying the store is closed, and the process must not crash."""
    r = run_py(_IN_FLIGHT.format(tmp=str(tmp_path), mode=mode))
    ok = r.returncode == 0 and ("OUTCOME OK" in r.stdout or "OUTCOME CLOSED" in r.stdout)
    assert ok, (r.returncode, r.stdout, r.stderr[-2000:])


# Regression (once failed): TuttiStore.finish: the native finish frees the request id before the
# wrapper pops _ops/_keys under _lock; a begin in another thread in between gets the same id, so
# finish pops the other request's keys (on_commit reports key 2 for a unit stored as key 1) and
# the other request's finish raises 'no request in flight'/KeyError, leaving it open in the native
# store (seen with real threads too)
def test_request_ids_reused_between_threads(stored, monkeypatch):
    import tutti_cluster.store as store_mod

    s, kv, d, unit = stored
    ub = s.unit_blocks
    committed: list[int] = []
    s.on_commit = committed.append
    a = s.begin_store([1], np.arange(ub) + 40)
    for l in range(s.num_layers):
        s.store_layer(l, a)
    real = store_mod.struct_dict
    other: list[int] = []

    def interleave(obj):  # another thread runs right after the native finish returned
        monkeypatch.setattr(store_mod, "struct_dict", real)
        other.append(s.begin_store([2], np.arange(ub) + 60))
        return real(obj)

    monkeypatch.setattr(store_mod, "struct_dict", interleave)
    res = s.finish(a)
    assert res.committed_units == [0]
    assert committed == [1], f"request {a}'s unit reported as {committed} (the other request is {other})"
    b = other[0]
    for l in range(s.num_layers):
        s.store_layer(l, b)
    assert s.finish(b).committed_units == [0]
    assert committed == [1, 2]


# ---- crash: SIGKILL mid-way through stores and imports ---------------------------------------------------

_WRITER = """
    import sys, numpy as np
    from crash_writer import unit_data
    from conftest import make_kv, BLOCK_TOKENS
    from tutti_cluster import TuttiConfig, TuttiStore
    path, start, imports = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    kv = make_kv(seed=0)
    s = TuttiStore(TuttiConfig(paths=[path], capacity_gb=0.01, unit_tokens=64, staging_mb=2, min_io_bytes=4096))
    s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS)
    ub = s.unit_blocks
    units = [(int(f.stem), f.read_bytes()) for f in sorted(__import__("pathlib").Path(imports).glob("*.unit"))]
    key, i = start, 0
    while True:
        keys = list(range(key, key + 4))
        for l in range(len(kv)):
            for u, k in enumerate(keys):
                kv[l][:, u * ub:(u + 1) * ub] = unit_data(k, kv[l].shape, ub, l)
        assert s.store(keys, np.arange(4 * ub)).ok
        s.remove(keys[0])  # frees a slot mid-stream too
        for _ in range(2):
            k, u = units[i % len(units)]
            s.remove(k)  # so that the import writes it again
            assert s.import_unit(u) == k
            i += 1
        print(key, flush=True)
        key += 4
"""


@pytest.mark.parametrize("fs", ["disk", "shm"])
def test_kill_9_mid_store_and_import_leaves_only_exact_units(tmp_path, fs):
    import shutil
    import tempfile

    from crash_writer import unit_data

    if fs == "shm" and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = Path(tempfile.mkdtemp(dir="/dev/shm")) if fs == "shm" else tmp_path / "ssd"
    d.mkdir(exist_ok=True)
    try:
        _kill_rounds(tmp_path, d, unit_data)
    finally:
        if fs == "shm":
            shutil.rmtree(d, ignore_errors=True)


def _kill_rounds(tmp_path, d, unit_data):
    imports = tmp_path / "units"
    imports.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    kv = make_kv(seed=0)
    with open_store([src], kv, capacity_gb=0.01) as a:
        ub = a.unit_blocks
        ikeys = list(range(900_000, 900_008))
        for i in range(0, len(ikeys), 4):
            ks = ikeys[i:i + 4]
            for l in range(len(kv)):
                for u, k in enumerate(ks):
                    kv[l][:, u * ub:(u + 1) * ub] = unit_data(k, kv[l].shape, ub, l)
            assert a.store(ks, np.arange(4 * ub)).ok
        for k in ikeys:
            (imports / f"{k}.unit").write_bytes(a.read_unit(k))
    rng = np.random.default_rng(1)
    start = 1
    for round_ in range(3):
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_WRITER), str(d), str(start), str(imports)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE, env=ENV)
        for _ in range(2 + round_):
            assert p.stdout.readline(), p.stderr.read()
        time.sleep(float(rng.uniform(0, 0.02)))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        start += 10_000
        r = reader(d)
        try:
            keys = r.keys()
            assert keys
            for k in keys:  # every unit the reader finds verifies and is exactly what was written
                got = r.read_unit(k)
                if k >= 900_000:
                    assert got[g0(r):] == (imports / f"{k}.unit").read_bytes()[g0(r):]
        finally:
            r.close()
        kv2 = make_kv(seed=1)
        with open_store([d], kv2, capacity_gb=0.01) as s:
            assert sorted(s.keys()) == sorted(keys)
            ub = s.unit_blocks
            for i in range(0, len(keys), 4):
                batch = keys[i:i + 4]
                zero(kv2)
                res = s.retrieve(batch, np.arange(len(batch) * ub))
                assert res.ok, f"round {round_}: {res.failed_units} of {batch} listed but not intact"
                for l in range(len(kv2)):
                    for u, k in enumerate(batch):
                        np.testing.assert_array_equal(kv2[l][:, u * ub:(u + 1) * ub], unit_data(k, kv2[l].shape, ub, l))


# -- an attack on main (2026-12-04): stale copies, other layouts' pools, removals under a read -------------

def _units(kv: list, blocks) -> list:
    return [t[:, blocks].copy() for t in kv]


def _same(a: list, b: list) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("hide", ["capacity", "path"])
def test_a_key_stored_while_an_older_copy_was_out_of_sight_is_the_one_served(tmp_path, hide):
    """Regression (once failed): a copy of key K in a part of the pool an open did not see (past a
    lowered capacity: the tail of a pool file is never truncated; or on a path left out of the
    configuration) came back with a higher commit sequence than K stored meanwhile, and a retrieve
    of K served the older bytes with ok."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    kv = make_kv(seed=41)
    ub = UNIT_TOKENS // BLOCK_TOKENS
    full = dict(paths=[a, b], capacity_gb=[0.02, 0.02])
    if hide == "capacity":  # K in the high slots, then a capacity that ends below them
        first, second = full, dict(paths=[a, b], capacity_gb=[0.002, 0.002])
    else:  # K on path b, then a configuration without b
        first, second = dict(paths=[b], capacity_gb=[0.02]), dict(paths=[a], capacity_gb=[0.02])
    with open_store([a], kv, **first) as s:
        for i in range(s.stats()["total_slots"] - 2 if hide == "capacity" else 0):
            assert s.store([1000 + i], np.arange(ub)).ok
        assert s.store([42], np.arange(ub)).ok
        old = _units(kv, np.arange(ub))
    refill = np.random.default_rng(7)
    for t in kv:
        t[...] = refill.integers(0, 60000, t.shape, dtype=t.dtype)
    with open_store([a], kv, **second) as s:
        assert not s.contains(42)
        assert s.store([42], np.arange(ub)).ok
        new = _units(kv, np.arange(ub))
    assert not _same(old, new)
    for opened in range(2):  # the writer, then a fresh open
        zero(kv)
        with open_store([a], kv, **full) as s:
            r = s.retrieve([42], np.arange(ub, 2 * ub))
            assert r.ok and _same(_units(kv, np.arange(ub, 2 * ub)), new), opened
    # Removed, it stays removed: the older copy is gone too (it came back at the next open once).
    with open_store([a], kv, **full) as s:
        assert s.remove(42)
    with open_store([a], kv, **full) as s:
        assert not s.contains(42) and not s.retrieve([42], np.arange(ub)).ok


def test_a_pool_file_of_another_layout_is_refused_with_none_of_its_units_left(tmp_path):
    """Regression (once failed): the layout check read headers at the opening store's own slot
    boundaries only, so once a pool's first slot was free (its unit removed or evicted) a store of
    another layout took the pool over and wrote over its units. Freed slots and never-written
    first slots now carry the layout's free-slot header."""
    d = tmp_path / "p"
    d.mkdir()
    ub = UNIT_TOKENS // BLOCK_TOKENS
    with open_store([d], make_kv(seed=1)) as s:
        for k in range(1, 7):
            assert s.store([k], np.arange(ub)).ok
        assert s.remove(1)
    with pytest.raises(LayoutError, match="another layout"):
        open_store([d], make_kv(seed=2, head=48))
    with open_store([d], make_kv(seed=1)) as s:  # the owner's units are all there
        assert s.lookup(list(range(2, 7))) == 5 and s.stats()["units"] == 5
        for k in range(2, 7):
            assert s.remove(k)
    with pytest.raises(LayoutError, match="another layout"):  # emptied, still the owner's
        open_store([d], make_kv(seed=2, head=48))
    e = tmp_path / "new"
    e.mkdir()
    open_store([e], make_kv(seed=1)).close()  # opened once, never stored into
    with pytest.raises(LayoutError, match="another layout"):
        open_store([e], make_kv(seed=2, head=48))


def test_remove_leaves_a_unit_a_retrieve_is_reading(tmp_path):
    """Regression (once failed): remove() dropped a unit a begun retrieve had pinned; the next
    store took its slot, and the retrieve failed and counted a checksum failure that was no damage
    (the admin plane's remove and drain racing an engine's load)."""
    d = tmp_path / "p"
    d.mkdir()
    kv = make_kv(seed=5)
    ub = UNIT_TOKENS // BLOCK_TOKENS
    with open_store([d], kv) as s:
        assert s.store([1], np.arange(ub)).ok
        want = _units(kv, np.arange(ub))
        req = s.begin_retrieve([1], np.arange(2 * ub, 3 * ub))
        assert not s.remove(1) and s.contains(1)  # it stays while read
        assert s.store([2], np.arange(ub, 2 * ub)).ok
        for layer in range(len(kv)):
            s.retrieve_layer(layer, req)
        r = s.finish(req)
        assert r.ok and s.stats()["checksum_failures"] == 0
        assert _same(_units(kv, np.arange(2 * ub, 3 * ub)), want)
        assert s.remove(1) and not s.contains(1)  # and goes once the read is done


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs a memory file system at /dev/shm")
def test_a_mapped_pool_file_cut_short_under_the_store_is_a_miss_not_a_crash(tmp_path):
    """Regression (once failed): a pool file on tmpfs is mapped, and one truncated by someone else
    under a running store ended the process with SIGBUS at the next retrieve of a unit in the cut
    part; it is a miss now (failed units, as on a disk's file), a store there fails its units, and
    a SIGBUS elsewhere still ends the process as before. In a child: a defect kills it, not pytest."""
    import tempfile
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tutti-test-bus-"))
    try:
        r = run_py(f"""
            import os, signal, numpy as np
            from conftest import make_kv, open_store, UNIT_TOKENS, BLOCK_TOKENS
            from pathlib import Path
            d = Path({str(d)!r})
            ub = UNIT_TOKENS // BLOCK_TOKENS
            s = open_store([d], make_kv(seed=9), pool_files=1)
            assert s.stats()["total_slots"] > 4
            assert s.store([1, 2, 3], np.arange(3 * ub)).ok
            os.truncate(d / "tutti-default.pool", 4096)
            res = s.retrieve([1, 2, 3], np.arange(3 * ub, 6 * ub))
            assert not res.ok and sorted(res.failed_units) == [0, 1, 2], res
            res = s.store([4, 5], np.arange(2 * ub))
            assert not res.ok, res
            s.close()
            print("survived", flush=True)
            signal.raise_signal(signal.SIGBUS)  # not the store's: the default action still ends the process
        """)
        assert "survived" in r.stdout, r.stdout + r.stderr
        # The same SIGBUS the default way, from a load through a mapping cut short, with SIGBUS
        # ignored before the store opened: it still ends the process (it spun at 100 % once).
        r = run_py(f"""
            import mmap, os, signal, numpy as np
            from conftest import make_kv, open_store, UNIT_TOKENS, BLOCK_TOKENS
            from pathlib import Path
            d = Path({str(d)!r})
            signal.signal(signal.SIGBUS, signal.SIG_IGN)
            s = open_store([d], make_kv(seed=9), pool_files=1)
            assert s.store([1], np.arange(UNIT_TOKENS // BLOCK_TOKENS)).ok
            f = d / "other.bin"
            f.write_bytes(b"x" * 65536)
            fd = os.open(f, os.O_RDWR)
            m = mmap.mmap(fd, 65536)
            os.ftruncate(fd, 0)
            print("survived", flush=True)
            m[40000]
        """, timeout=30)
        assert "survived" in r.stdout, r.stdout + r.stderr
        # The disposition before the store's: the default, or a sanitizer's own report (CI's ASan run).
        assert r.returncode == -signal.SIGBUS or "AddressSanitizer: BUS" in r.stderr, (r.returncode, r.stderr[-2000:])
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)

"""Guards at the Python edge of the store (store.py, kv_layout.py, config.py):

- the memory of registered KV tensors: a tensor whose memory moved or shrank since
  ``register_kv_caches`` (``t.set_()``, ``t.resize_()``, ``t.untyped_storage().resize_(0)``, numpy's
  ``resize(refcheck=False)``) is refused with a LayoutError before the native core, which holds raw
  pointers into it, writes there; registering again makes the store work again;
- numpy KV arrays whose byte strides are not whole elements are refused (they were rounded down,
  and a store and retrieve reported ok while moving other bytes);
- settings past the native fields' widths (or their practical caps) are a ConfigError naming the
  setting, never pybind11's TypeError or std::bad_alloc.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from conftest import BLOCK_TOKENS, HEAD, HEADS, UNIT_TOKENS
from tutti_cluster import TuttiConfig, TuttiStore
from tutti_cluster.config import native_options
from tutti_cluster.errors import ConfigError, LayoutError
from tutti_cluster.kv_layout import layer_kv_from_tensor, layer_kv_from_vllm, layers_from_cross_layer_tensor

LAYERS, BLOCKS = 3, 16
SHAPE = (2, BLOCKS, BLOCK_TOKENS, HEADS, HEAD)  # kv_first
UB = UNIT_TOKENS // BLOCK_TOKENS  # blocks per unit


def _cfg(d: Path, **kw) -> TuttiConfig:
    return TuttiConfig(**{**dict(paths=[d], capacity_gb=0.01, unit_tokens=UNIT_TOKENS, staging_mb=2,
                                 min_io_bytes=4096, iocb_depth=64), **kw})


def _torch_kv(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 30000, SHAPE, dtype=torch.int16, generator=g) for _ in range(LAYERS)]


def _store(d: Path, kv: list, **kw) -> TuttiStore:
    s = TuttiStore(_cfg(d, **kw.pop("config", {})))
    s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS, **kw)
    return s


# ---- 1. registered KV memory that moved ---------------------------------------------------------

def test_set_tensor_is_refused_at_every_entry_point_and_registering_again_works(tmp_path):
    kv = _torch_kv()
    s = _store(tmp_path, kv)
    try:
        assert s.store([1, 2], np.arange(2 * UB)).ok
        stored = [t[:, :2 * UB].clone() for t in kv]
        unit = s.read_unit(1)
        # A request begun before the tensor moves: its layer calls for that layer are refused.
        req = s.begin_retrieve([1], np.arange(8, 8 + UB))
        keep = kv[1].untyped_storage()  # (so that, unguarded, the old memory stays mapped)
        kv[1].set_(torch.zeros(SHAPE, dtype=torch.int16))
        s.retrieve_layer(0, req)
        with pytest.raises(LayoutError, match="layer 1 moved or was resized since register_kv_caches"):
            s.retrieve_layer(1, req)
        assert s.finish(req).failed_units  # layer 1 never ran: a miss, nothing presented as KV
        with pytest.raises(LayoutError, match="layer 1 moved"):
            s.retrieve([1, 2], np.arange(8, 8 + 2 * UB))
        with pytest.raises(LayoutError, match="layer 1 moved"):
            s.begin_store([3], np.arange(UB))
        with pytest.raises(LayoutError, match="layer 1 moved"):
            s.scatter_unit(unit, np.arange(8, 8 + UB))
        with pytest.raises(LayoutError, match="layer 1 moved"):
            s.scatter_unit_async(unit, np.arange(8, 8 + UB))
        with pytest.raises(LayoutError, match="layer 1 moved"):
            s.issue_io([])
        assert s.lookup([1, 2]) == 2  # reads of the pool alone go on
        del keep
    finally:
        s.close()
    # Registered again (the same store object, the tensors as they are now): everything works.
    s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS)
    try:
        for t in kv:
            t.zero_()
        r = s.retrieve([1, 2], np.arange(8, 8 + 2 * UB))
        assert r.ok
        for t, want in zip(kv, stored):
            assert torch.equal(t[:, 8:8 + 2 * UB], want)
        assert s.store([3], np.arange(8, 8 + UB)).ok
    finally:
        s.close()


CHILD = textwrap.dedent('''
    import sys, logging
    from pathlib import Path
    import numpy as np, torch
    from tutti_cluster import TuttiConfig, TuttiStore
    from tutti_cluster.errors import LayoutError
    logging.disable(logging.WARNING)
    root = Path(sys.argv[1])
    SHAPE = (2, 64, 16, 2, 32)  # 256 KiB per layer: freed memory goes back to the system (munmap)

    def attack(name, kv, mutate):
        d = root / name; d.mkdir()
        s = TuttiStore(TuttiConfig(paths=[d], capacity_gb=0.01, unit_tokens=64, staging_mb=2,
                                   min_io_bytes=4096, iocb_depth=64))
        s.register_kv_caches(kv, block_tokens=16)
        assert s.store([1, 2], np.arange(8)).ok
        mutate(kv)
        try:
            r = s.retrieve([1, 2], np.arange(8, 16))
            print("accepted", name, r.ok, flush=True)
        except LayoutError as e:
            assert "layer 1 moved or was resized" in str(e), e
            print("refused", name, flush=True)
        s.close()

    def torch_kv():
        return [torch.ones(SHAPE, dtype=torch.int16) for _ in range(2)]

    def np_kv():
        return [np.ones(SHAPE, np.uint16) for _ in range(2)]

    def np_view_kv():  # views of owning arrays: the owner is what moves
        return [np.ones((3,) + SHAPE, np.uint16)[1] for _ in range(2)]

    attack("torch_set", torch_kv(), lambda kv: kv[1].set_(torch.empty(0, dtype=torch.int16)))
    attack("torch_resize_bigger", torch_kv(), lambda kv: kv[1].resize_(4, *SHAPE[1:]))
    attack("torch_storage_freed", torch_kv(), lambda kv: kv[1].untyped_storage().resize_(0))
    attack("torch_storage_shrunk", torch_kv(), lambda kv: kv[1].untyped_storage().resize_(100))
    attack("numpy_resize", np_kv(), lambda kv: kv[1].resize((4,) + SHAPE[1:], refcheck=False))
    attack("numpy_base_resize", np_view_kv(), lambda kv: kv[1].base.resize(7, refcheck=False))
    owners = [np.ones(SHAPE, np.uint16) for _ in range(2)]  # as_strided: a view through an interface holder
    attack("numpy_as_strided_base_resize", [np.lib.stride_tricks.as_strided(a, a.shape, a.strides) for a in owners],
           lambda kv: owners[1].resize((4,) + SHAPE[1:], refcheck=False))
    print("done", flush=True)
''')


def test_freed_or_moved_memory_is_refused_not_written(tmp_path):
    """Every way the attack found to free or move a registered tensor's memory, in a child (an
    unguarded store writes into freed memory: a SIGSEGV or heap corruption)."""
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)  # not the source tree: the package as installed (or as CI sanitizes it)
    out = p.stdout
    assert p.returncode == 0, f"child exit status {p.returncode}\n{out}\n{p.stderr[-3000:]}"
    assert "accepted" not in out, out
    for name in ("torch_set", "torch_resize_bigger", "torch_storage_freed", "torch_storage_shrunk",
                 "numpy_resize", "numpy_base_resize", "numpy_as_strided_base_resize"):
        assert f"refused {name}" in out, out


def test_in_place_writes_and_views_are_not_refused(tmp_path):
    """The guard has no false alarms: views with storage offsets, (K, V) pairs, a cross-layer tensor,
    vLLM descriptors and in-place writes keep working."""
    base = torch.zeros((LAYERS + 1,) + SHAPE, dtype=torch.int16)
    kv = [base[i + 1] for i in range(LAYERS)]  # views at a storage offset
    d1 = tmp_path / "views"; d1.mkdir()
    s = _store(d1, kv, layout="kv_first")
    try:
        for t in kv:
            t.copy_(torch.randint(1, 9999, SHAPE, dtype=torch.int16))
        want = [t[:, :UB].clone() for t in kv]
        assert s.store([1], np.arange(UB)).ok
        base.zero_()
        assert s.retrieve([1], np.arange(UB, 2 * UB)).ok
        assert all(torch.equal(t[:, UB:2 * UB], w) for t, w in zip(kv, want))
    finally:
        s.close()
    pairs = [(torch.ones(SHAPE[1:], dtype=torch.int16), torch.ones(SHAPE[1:], dtype=torch.int16))
             for _ in range(LAYERS)]
    d2 = tmp_path / "pairs"; d2.mkdir()
    s = _store(d2, pairs, layout="kv_tuple")
    try:
        assert s.store([1], np.arange(UB)).ok and s.retrieve([1], np.arange(UB, 2 * UB)).ok
        keep = pairs[2][1].untyped_storage()
        pairs[2][1].set_(torch.zeros(1, dtype=torch.int16))
        with pytest.raises(LayoutError, match="layer 2 moved"):
            s.retrieve([1], np.arange(UB))
        del keep
    finally:
        s.close()
    # One tensor holding every layer, blocks outermost, and vLLM's descriptors: the descriptors
    # carry the tensor, so the store guards it too.
    cross = torch.ones(BLOCKS, LAYERS, 2, BLOCK_TOKENS, HEADS, HEAD, dtype=torch.int16)
    d3 = tmp_path / "cross"; d3.mkdir()
    s = _store(d3, layers_from_cross_layer_tensor(cross, LAYERS))
    try:
        assert s.store([1], np.arange(UB)).ok and s.retrieve([1], np.arange(UB, 2 * UB)).ok
        keep = cross.untyped_storage()
        cross.set_(torch.zeros(1, dtype=torch.int16))
        with pytest.raises(LayoutError, match="layer 0 moved"):
            s.begin_retrieve([1], np.arange(UB))
        del keep
    finally:
        s.close()
    vllm = [torch.ones(BLOCKS, BLOCK_TOKENS, HEADS, 2 * HEAD, dtype=torch.int16) for _ in range(LAYERS)]
    d4 = tmp_path / "vllm"; d4.mkdir()
    s = _store(d4, [layer_kv_from_vllm(t, BLOCKS) for t in vllm])
    try:
        assert s.store([1], np.arange(UB)).ok and s.retrieve([1], np.arange(UB, 2 * UB)).ok
        keep = vllm[0].untyped_storage()
        vllm[0].set_(torch.zeros(1, dtype=torch.int16))
        with pytest.raises(LayoutError, match="layer 0 moved"):
            s.begin_store([2], np.arange(UB))
        del keep
    finally:
        s.close()


# ---- 2. numpy strides that are not whole elements -----------------------------------------------

def _odd_array(extra_block: int, extra_kv: int, dtype=np.uint16, blocks: int = 8) -> np.ndarray:
    """A kv_first array over a byte buffer whose block and K/V strides step ``extra_*`` bytes past
    whole blocks (the inner dimensions dense), filled with distinct values."""
    es = np.dtype(dtype).itemsize
    inner = (BLOCK_TOKENS, HEADS, HEAD)
    block_bytes = int(np.prod(inner)) * es
    bstride = block_bytes + extra_block
    kstride = bstride * blocks + extra_kv
    strides = (kstride, bstride, HEADS * HEAD * es, HEAD * es, es)
    buf = bytearray(kstride + bstride * blocks + 64)
    a = np.ndarray((2, blocks) + inner, dtype=dtype, buffer=buf, strides=strides)
    a[...] = np.arange(a.size, dtype=np.int64).reshape(a.shape) % 50000 + 1
    return a


def test_unaligned_numpy_strides_are_refused_naming_the_stride(tmp_path):
    kv = [_odd_array(1, 1), _odd_array(1, 1)]
    s = TuttiStore(_cfg(tmp_path))
    with pytest.raises(LayoutError, match=r"stride 16\d+ \(dimension 0\) is not a multiple of its element size"):
        s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS, layout="kv_first")
    with pytest.raises(LayoutError, match="stride 2049 .dimension 1."):
        layer_kv_from_tensor(_odd_array(1, 0), "kv_first")
    # vLLM's describer reads numpy arrays through the same check (it once had no numpy path at all).
    odd = np.ndarray((8, 1024), np.uint16, buffer=bytearray(8 * 2051 + 16), strides=(2051, 2))
    with pytest.raises(LayoutError, match="stride 2051"):
        layer_kv_from_vllm(odd, 8)
    # Whole-element strides with gaps are fine: a round trip moves exactly the array's blocks.
    kv = [_odd_array(2, 6), _odd_array(4, 2)]
    s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS, layout="kv_first")
    try:
        want = [t[:, :UB].copy() for t in kv]
        assert s.store([5], np.arange(UB)).ok
        for t in kv:
            t[...] = 0
        assert s.retrieve([5], np.arange(UB, 2 * UB)).ok
        for t, w in zip(kv, want):
            np.testing.assert_array_equal(t[:, UB:2 * UB], w)
    finally:
        s.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from([np.uint8, np.uint16, np.float32, np.float64]),
       extra_block=st.integers(0, 17), extra_kv=st.integers(0, 17), blocks=st.integers(1, 5),
       layout=st.sampled_from(["kv_first", "interleaved"]))
def test_a_described_block_is_exactly_the_arrays_block(dtype, extra_block, extra_kv, blocks, layout):
    """Property: for any byte strides, the descriptor is refused, or the bytes it names for each
    block (pointer + b * block_stride, block_bytes long) are that block of the array."""
    a = _odd_array(extra_block, extra_kv, dtype, blocks)
    es = a.itemsize
    if layout == "interleaved":
        a = a[0]  # [blocks, ...]: only the block stride
    whole = extra_block % es == 0 and (layout == "interleaved" or extra_kv % es == 0)
    note(f"strides {a.strides}, itemsize {es}")
    try:
        d = layer_kv_from_tensor(a, layout)
    except LayoutError as e:
        assert not whole, e
        assert "is not a multiple of its element size" in str(e)
        return
    assert whole
    objs = [a[0], a[1]] if layout == "kv_first" else [a]
    for kv, obj in enumerate(objs):
        for b in range(d.num_blocks):
            got = ctypes.string_at(d.ptrs[kv] + b * d.block_stride, d.block_bytes)
            assert got == obj[b].tobytes(), (kv, b)


# ---- 3. settings past the native fields --------------------------------------------------------

NATIVE_LIMITS = {  # setting -> (its documented cap, the native field's width)
    "queue_depth": (32767, 2**32 - 1),  # io_uring takes at most 32768 entries; the agent adds one
    "iocb_depth": (2**20, 2**32 - 1),
    "max_requests": (65536, 2**32 - 1),
    "io_sms": (1024, 2**32 - 1),
    "device": (1023, 2**31 - 1),
    "staging_mb": (2**20, 2**44 - 1),  # staging_bytes = staging_mb << 20, a uint64
    "copy_engine_mb": (2**20, 2**44 - 1),  # shifted by 20 bits like staging_mb
    "min_io_bytes": (2**30, 2**64 - 1),
    "unit_tokens": (2**20, 2**32 - 1),  # blocks per unit, a uint32, are at most unit_tokens
}
ATTACK = [("queue_depth", 2**32), ("iocb_depth", 2**32), ("max_requests", 2**32), ("max_requests", 10**9),
          ("io_sms", 2**32), ("device", 2**31), ("staging_mb", 2**44), ("copy_engine_mb", 2**44),
          ("copy_engine_mb", -1), ("min_io_bytes", 2**64),
          ("unit_tokens", 16 * 2**32), ("unit_tokens", 2**32)]


@pytest.mark.parametrize("field,value", ATTACK)
def test_settings_past_the_native_fields_are_a_config_error_naming_them(tmp_path, monkeypatch, field, value):
    with pytest.raises(ConfigError, match=field):
        _cfg(tmp_path, **{field: value})
    monkeypatch.setenv(f"TUTTI_{field.upper()}", str(value))  # every source, the environment too
    with pytest.raises(ConfigError, match=field):
        TuttiConfig(paths=[tmp_path])


@pytest.mark.parametrize("field", sorted(NATIVE_LIMITS))
def test_the_caps_themselves_are_accepted(tmp_path, field):
    cap = NATIVE_LIMITS[field][0]
    cfg = _cfg(tmp_path, **{field: cap})
    native_options(cfg, backend="cpu", unit_blocks=cfg.unit_tokens // BLOCK_TOKENS)
    with pytest.raises(ConfigError, match=field):
        _cfg(tmp_path, **{field: cap + 1})


@pytest.mark.parametrize("field,value", [f for f in ATTACK if f[1] != 10**9 and f != ("unit_tokens", 2**32)])
def test_configs_that_skipped_validation_still_fail_as_config_errors(tmp_path, field, value):
    """model_copy(update=...) skips validation: the store's translation checks the native widths
    again, so an open names the setting, never pybind11's TypeError."""
    cfg = _cfg(tmp_path).model_copy(update={field: value})
    s = TuttiStore(cfg)
    kv = [np.zeros(SHAPE, np.uint16) for _ in range(2)]
    with pytest.raises(ConfigError, match=field):
        s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS)
    assert s._native is None


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(sorted(NATIVE_LIMITS)),
       value=st.one_of(st.integers(1, 2**21), st.integers(1, 2**70),
                       st.sampled_from([2**31, 2**32, 2**44, 2**64, 10**9])))
def test_every_accepted_setting_fits_its_native_field(field, value):
    """Property: a value TuttiConfig accepts is at most its cap and translates into the native
    options (pybind11 refuses what does not fit its field); one it refuses is a ConfigError naming it."""
    cap, width = NATIVE_LIMITS[field]
    try:
        cfg = TuttiConfig(paths=["/nonexistent/tutti"], **{field: value})
    except ConfigError as e:
        assert value > cap and field in str(e)
        return
    assert value <= cap <= width
    native_options(cfg, backend="cpu", unit_blocks=cfg.unit_tokens)  # block_tokens 1: the most blocks


def test_absurd_max_requests_is_refused_before_any_allocation(tmp_path):
    with pytest.raises(ConfigError, match="max_requests: Input should be less than or equal to 65536"):
        TuttiStore(paths=[tmp_path], max_requests=10**9)

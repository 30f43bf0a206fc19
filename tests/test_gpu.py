"""The CUDA backend on a real GPU: byte-exact round trips into paged CUDA tensors for every layout,
concurrent requests, ring stress, stream ordering, checksum failures, compute on the complement
SM partition, and two store processes on two GPUs.

Every test here is marked ``gpu`` and skips, saying why, where no CUDA device or no CUDA build is
present. ``test_cuda_backend_without_a_device`` runs where the build has CUDA but the host has no
GPU (the CI host): it checks that the CUDA backend fails cleanly there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import LAYOUTS
from tutti_cluster import TuttiConfig, TuttiStore, _native
from tutti_cluster.errors import DeviceError
from tutti_cluster.kv_layout import LayerKV

try:
    import torch

    HAVE_GPU = torch.cuda.is_available()
except ImportError:  # the CI image may lack torch entirely
    torch = None  # type: ignore[assignment]
    HAVE_GPU = False


needs_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.has_cuda, reason="this build of the native module has no CUDA backend"),
    pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to torch"),
]


def gpu(f: Any) -> Any:
    for m in needs_gpu:
        f = m(f)
    return f


# ---- helpers -------------------------------------------------------------------------------------


def _bits(t: "torch.Tensor") -> "torch.Tensor":
    """The raw bits of a tensor, for byte-exact comparison."""
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _random(shape: tuple[int, ...], dtype: "torch.dtype", gen: "torch.Generator") -> "torch.Tensor":
    if dtype.itemsize == 2:
        x = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device="cuda", generator=gen)
    else:
        x = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device="cuda", generator=gen)
    return x.view(dtype)


def make_gpu_kv(layout: str, layers: int, blocks: int, block_shape: tuple[int, ...] = (16, 2, 64),
                dtype: "torch.dtype | None" = None, seed: int = 0) -> list:
    """Random paged KV caches on the GPU in ``layout``. block_shape: (tokens, heads, head_size)."""
    dtype = dtype or torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t, h, d = block_shape
    if layout == "kv_first":
        return [_random((2, blocks, t, h, d), dtype, gen) for _ in range(layers)]
    if layout == "block_first":
        return [_random((blocks, 2, t, h, d), dtype, gen) for _ in range(layers)]
    if layout == "kv_tuple":
        return [(_random((blocks, t, h, d), dtype, gen), _random((blocks, t, h, d), dtype, gen)) for _ in range(layers)]
    if layout == "interleaved":
        return [_random((blocks, t, h, 2 * d), dtype, gen) for _ in range(layers)]
    if layout == "mla":
        return [_random((blocks, t, h * d), dtype, gen) for _ in range(layers)]
    raise ValueError(layout)


def objects(layer: Any, layout: str) -> list:
    """[kv] -> tensor indexed by block on dim 0."""
    if layout == "kv_first":
        return [layer[0], layer[1]]
    if layout == "block_first":
        return [layer[:, 0], layer[:, 1]]
    if layout == "kv_tuple":
        return list(layer)
    return [layer]


def clone(kv: list) -> list:
    return [tuple(x.clone() for x in l) if isinstance(l, tuple) else l.clone() for l in kv]


def poison(kv: list, value: int = 0x5A5A) -> None:
    for l in kv:
        for x in l if isinstance(l, tuple) else (l,):
            _bits(x).fill_(value if x.element_size() == 2 else value * 65537)


def assert_moved(want: list, src_blocks: Any, got: list, dst_blocks: Any, layout: str) -> None:
    src = torch.as_tensor(np.asarray(src_blocks), device="cuda")
    dst = torch.as_tensor(np.asarray(dst_blocks), device="cuda")
    for l in range(len(want)):
        for a, b in zip(objects(want[l], layout), objects(got[l], layout)):
            x, y = _bits(a).index_select(0, src), _bits(b).index_select(0, dst)
            assert torch.equal(x, y), f"layer {l}: retrieved blocks differ from the stored ones"


def open_gpu_store(dirs: list[Path], kv: list, layout: str, block_tokens: int = 16, **cfg: Any) -> TuttiStore:
    # map_memory_paths off: tests on /dev/shm exercise the io_uring path unless they ask for the mapping.
    base = dict(paths=[str(d) for d in dirs], capacity_gb=0.25, unit_tokens=64, staging_mb=8, backend="cuda",
                io_sms=8, instance="gpu", map_memory_paths=False)
    base.update(cfg)
    s = TuttiStore(TuttiConfig(**base))
    s.register_kv_caches(kv, block_tokens=block_tokens, layout=layout)
    return s


@pytest.fixture
def dirs(tmp_path: Path) -> list[Path]:
    out = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        out.append(d)
    return out


@pytest.fixture
def shm_dirs() -> Any:
    """Two directories on /dev/shm (tmpfs) where it exists, for the larger tests."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="tutti-gpu-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    out = [root / "a", root / "b"]
    for d in out:
        d.mkdir()
    yield out
    shutil.rmtree(root, ignore_errors=True)


# ---- without a GPU -------------------------------------------------------------------------------


@pytest.mark.skipif(not _native.has_cuda, reason="this build of the native module has no CUDA backend")
@pytest.mark.skipif(HAVE_GPU, reason="a GPU is present: the GPU tests cover the backend")
def test_cuda_backend_without_a_device(dirs: list[Path]) -> None:
    """A CUDA build imports and runs the CPU backend anywhere; the CUDA backend says why it cannot start."""
    buf = np.zeros(4096 * 8, dtype=np.uint8)
    ptr = buf.__array_interface__["data"][0]
    layer = LayerKV((ptr,), 4096, 4096, 8, device="cuda", dtype="uint8", block_shape=(4096,))
    s = TuttiStore(TuttiConfig(paths=[str(d) for d in dirs], capacity_gb=0.01, unit_tokens=16, backend="cuda"))
    with pytest.raises(DeviceError):
        s.register_kv_caches([layer, layer], block_tokens=16)
    s.close()


# ---- round trips ---------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_every_layout(dirs: list[Path], layout: str) -> None:
    kv = make_gpu_kv(layout, layers=4, blocks=160, seed=1)
    rng = np.random.default_rng(11)
    with open_gpu_store(dirs, kv, layout) as s:
        assert s.stats()["backend"] == "cuda"
        ub = s.unit_blocks
        keys = [int(k) for k in rng.integers(1, 1 << 62, 24)]
        src = rng.permutation(160)[: 24 * ub]
        res = s.store(keys, src)
        assert res.ok and res.committed_units == list(range(24)), res
        assert s.lookup(keys) == 24
        want = clone(kv)
        poison(kv)
        dst = rng.permutation(160)[: 24 * ub]
        res = s.retrieve(keys, dst)
        torch.cuda.synchronize()
        assert res.ok, res
        assert_moved(want, src, kv, dst, layout)
        # Blocks outside the request keep the poison.
        rest = torch.as_tensor(sorted(set(range(160)) - set(dst.tolist())), device="cuda")
        first = objects(kv[0], layout)[0]
        assert bool((_bits(first).index_select(0, rest) == 0x5A5A).all())
        # The GPU's checksums are the CPU's: read_unit verifies every object on the CPU.
        data = s.read_unit(keys[3])
        assert len(data) == s.geometry()["slot_bytes"]


@gpu
@pytest.mark.parametrize("store_pair,load_pair", [("0", "1"), ("1", "0")])
def test_kv_pairing_keeps_the_file_format(dirs: list[Path], monkeypatch: pytest.MonkeyPatch, store_pair: str,
                                          load_pair: str) -> None:
    """With TUTTI_CUDA_PAIR=1, K and V of a unit-layer move as one I/O (the default moves them one by
    one): units stored either way load byte-exact the other way, after a reopen from the on-disk headers."""
    kv = make_gpu_kv("kv_first", layers=3, blocks=96, seed=5)
    rng = np.random.default_rng(17)
    keys = [int(k) for k in rng.integers(1, 1 << 62, 12)]
    monkeypatch.setenv("TUTTI_CUDA_PAIR", store_pair)
    with open_gpu_store(dirs, kv, "kv_first") as s:
        src = rng.permutation(96)[: 12 * s.unit_blocks]
        res = s.store(keys, src)
        assert res.ok and res.committed_units == list(range(12)), res
    want = clone(kv)
    poison(kv)
    monkeypatch.setenv("TUTTI_CUDA_PAIR", load_pair)
    with open_gpu_store(dirs, kv, "kv_first") as s:
        assert s.lookup(keys) == 12
        dst = rng.permutation(96)[: 12 * s.unit_blocks]
        res = s.retrieve(keys, dst)
        torch.cuda.synchronize()
        assert res.ok, res
        assert_moved(want, src, kv, dst, "kv_first")
        s.read_unit(keys[0])  # the CPU verifies the checksums the GPU wrote


@gpu
@pytest.mark.parametrize("mapped", [False, True], ids=["io_uring", "mapped"])
def test_partial_last_units(shm_dirs: list[Path], dirs: list[Path], mapped: bool) -> None:
    """A request's last unit holding fewer blocks: stored and retrieved byte-exact by the I/O kernel
    (whose bytes past the blocks are zeros under the CRC), the CPU agrees on its checksums, a unit
    asked for more blocks than it holds is a miss that writes nothing, and a whole unit serves a
    prefix of its blocks."""
    kv = make_gpu_kv("kv_first", layers=3, blocks=96, seed=12)
    paths = [shm_dirs[0], dirs[0]]
    with open_gpu_store(paths, kv, "kv_first", map_memory_paths=mapped) as s:
        ub = s.unit_blocks
        for tail in (1, ub - 1):
            keys = [1000 * tail + i for i in range(4)]
            src = np.arange(3 * ub + tail)
            res = s.store(keys, src)
            assert res.ok and res.committed_units == [0, 1, 2, 3], res
            assert s.stored_blocks(keys) == [ub, ub, ub, tail]
            want = clone(kv)
            poison(kv)
            dst = np.arange(96 - len(src), 96)
            res = s.retrieve(keys, dst)
            torch.cuda.synchronize()
            assert res.ok, res
            assert_moved(want, src, kv, dst, "kv_first")
            rest = torch.arange(0, 96 - len(src), device="cuda")
            assert bool((_bits(kv[0][0]).index_select(0, rest) == 0x5A5A).all())
            s.read_unit(keys[3])  # the CPU verifies the GPU's checksums of the zero tail
            poison(kv)
            res = s.retrieve(keys[3:], np.arange(tail + 1))
            torch.cuda.synchronize()
            assert res.failed_units == [0], res
            assert bool((_bits(kv[0][0]) == 0x5A5A).all())
            res = s.retrieve(keys[:1], np.arange(1))  # one block of a whole unit
            torch.cuda.synchronize()
            assert res.ok, res
            assert_moved(want, src[:1], kv, [0], "kv_first")


@gpu
def test_inner_keys_name_the_leading_blocks_of_a_gpu_stored_unit(dirs: list[Path]) -> None:
    """Inner keys committed by a CUDA engine's store come back after a reopen, and the unit one of
    them names serves its leading blocks byte-exact through the I/O kernel."""
    kv = make_gpu_kv("kv_first", layers=3, blocks=96, seed=13)
    with open_gpu_store(dirs[:1], kv, "kv_first") as s:
        ub = s.unit_blocks
        inner = [[7000 + j for j in range(1, ub)], [8000 + j for j in range(1, ub)]]
        assert s.store([7, 8], np.arange(2 * ub), inner).ok
    want = clone(kv)
    with open_gpu_store(dirs[:1], kv, "kv_first") as s:
        names = s.inner_keys()
        assert names == {k: 7 for k in inner[0]} | {k: 8 for k in inner[1]}
        poison(kv)
        res = s.retrieve([names[8002]], np.arange(50, 52))  # 2 leading blocks of unit 8
        torch.cuda.synchronize()
        assert res.ok, res
        assert_moved(want, np.arange(ub, ub + 2), kv, np.arange(50, 52), "kv_first")


@gpu
def test_unaligned_objects_and_padding(dirs: list[Path]) -> None:
    """60-byte blocks (not 16-byte multiples) and objects padded to 4 KiB: the 4-byte kernel path."""
    kv = make_gpu_kv("kv_first", layers=3, blocks=64, block_shape=(3, 1, 5), dtype=torch.float32, seed=2)
    rng = np.random.default_rng(3)
    with open_gpu_store(dirs, kv, "kv_first", block_tokens=3, unit_tokens=12) as s:
        keys = list(range(100, 110))
        src = rng.permutation(64)[:40]
        assert s.store(keys, src).ok
        want = clone(kv)
        poison(kv)
        dst = rng.permutation(64)[:40]
        assert s.retrieve(keys, dst).ok
        torch.cuda.synchronize()
        assert_moved(want, src, kv, dst, "kv_first")


@gpu
@pytest.mark.parametrize("caller_stream", ["default", "side"])
def test_layer_calls_are_stream_ordered(dirs: list[Path], caller_stream: str) -> None:
    """store_layer runs after the caller's queued work; wait_layer orders the caller's stream after
    the retrieve, with no host synchronisation in between. On the default (legacy) stream, whose
    handle is 0, and on a stream of the caller's own."""
    kv = make_gpu_kv("kv_first", layers=2, blocks=64, seed=4)
    side = torch.cuda.Stream() if caller_stream == "side" else torch.cuda.default_stream()
    with open_gpu_store(dirs, kv, "kv_first") as s, torch.cuda.stream(side):
        blocks = list(range(32))
        keys = list(range(1, 9))
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # keeps the current stream busy for ~0.1 s
        for l in kv:
            l[:, :32].fill_(1.5)  # queued behind the sleep
        req = s.begin_store(keys, blocks)
        for layer in range(2):
            s.store_layer(layer, req)  # must gather the 1.5s, not the random contents
        assert s.finish(req).ok
        poison(kv)
        torch.cuda.synchronize()
        dst = list(range(32, 64))
        req = s.begin_retrieve(keys, dst)
        torch.cuda._sleep(200_000_000)
        for l in kv:
            l[:, 32:].fill_(-2.0)  # queued behind the sleep: the retrieve must land after it
        for layer in range(2):
            s.retrieve_layer(layer, req)
        seen = []
        for layer in range(2):
            s.wait_layer(layer, req)  # stream wait (a side stream: returns at once)
            seen.append(kv[layer][:, 32:].clone())  # queued on the current stream after the I/O
        assert s.finish(req).ok
        torch.cuda.synchronize()
        for x in seen:
            assert bool((x == 1.5).all()), "the current stream ran ahead of the retrieve, or the retrieve of its work"


@gpu
@pytest.mark.parametrize("copy_mb", [None, 1], ids=["io_uring", "copy_engine"])
def test_concurrent_requests(shm_dirs: list[Path], copy_mb: int | None) -> None:
    """Four requests in flight, their layer calls interleaved: through io_uring, and through the
    mapping with the copy engine's stage (two buffers of 512 KiB, taken in turn by the four
    requests' launches, each staging the 16 units of its 32 that fit and loading the rest)."""
    kv = make_gpu_kv("kv_first", layers=8, blocks=1024, seed=5)
    rng = np.random.default_rng(5)
    mode = {} if copy_mb is None else dict(map_memory_paths=True, copy_engine_mb=copy_mb)
    with open_gpu_store(shm_dirs, kv, "kv_first", capacity_gb=1.0, staging_mb=16, **mode) as s:
        ub = s.unit_blocks
        groups = [[int(k) for k in rng.integers(1, 1 << 62, 32)] for _ in range(4)]
        srcs = [rng.permutation(1024)[: 32 * ub] for _ in groups]
        reqs = [s.begin_store(k, b) for k, b in zip(groups, srcs)]
        for layer in range(8):
            for r in reqs:
                s.store_layer(layer, r)
        assert all(s.finish(r).ok for r in reqs)
        want = clone(kv)
        poison(kv)
        perm = rng.permutation(1024)
        dsts = [perm[i * 32 * ub : (i + 1) * 32 * ub] for i in range(4)]  # disjoint destinations
        reqs = [s.begin_retrieve(k, b) for k, b in zip(groups, dsts)]
        for layer in range(8):
            for r in reversed(reqs):
                s.retrieve_layer(layer, r)
        results = [s.finish(r) for r in reqs]
        torch.cuda.synchronize()
        assert all(r.ok for r in results), results
        for src, dst in zip(srcs, dsts):
            assert_moved(want, src, kv, dst, "kv_first")
        g, staged = s.geometry(), s.stats()["copy_engine_bytes"]
        unit_layer = g["objs_per_layer"] * g["obj_bytes"]
        if copy_mb is None:
            assert staged == 0
        else:  # a buffer's whole unit-layers per launch (one a request and layer), 4 requests x 8 layers
            per_launch = min((copy_mb << 20) // 2 // unit_layer, 32)
            assert 0 < per_launch < 32 and staged == 4 * 8 * per_launch * unit_layer, (staged, unit_layer)


@gpu
@pytest.mark.parametrize("layout", ["kv_first", "interleaved"])
def test_scatter_unit_from_host_memory_into_gpu_blocks(dirs: list[Path], layout: str) -> None:
    """The remote path on a GPU engine: units as another node sends them (read_unit's bytes) land
    byte-exact in GPU blocks, read in place from registered host memory (as the Transfer Engine's
    arena is) and from plain memory (copied first); a corrupt one is a miss (NotFound, counted)
    and changes no other unit's blocks; block ids past the cache are a LayoutError, not a miss."""
    from tutti_cluster.errors import LayoutError, NotFound

    kv = make_gpu_kv(layout, layers=3, blocks=64, seed=9)
    want = clone(kv)
    with open_gpu_store(dirs[:1], kv, layout) as s:
        ub = s.unit_blocks
        keys = [11, 12, 13]
        assert s.store(keys, list(range(3 * ub))).ok
        units = [s.read_unit(k) for k in keys]
    n = len(units[0])
    arena = bytearray(3 * n)
    for i, u in enumerate(units):
        arena[i * n:(i + 1) * n] = u
    arena[3 * n - 100] ^= 0x01  # one bit in the third unit's last object
    got = make_gpu_kv(layout, layers=3, blocks=64, seed=10)
    with open_gpu_store(dirs[1:], got, layout) as b:
        addr = b.register_host(arena)
        view = memoryview(arena)
        b.scatter_unit(view[:n], list(range(32, 32 + ub)))       # in place
        b.scatter_unit(bytes(units[1]), list(range(48, 48 + ub)))  # from a copy
        torch.cuda.synchronize()
        assert_moved(want, list(range(2 * ub)), got, list(range(32, 32 + ub)) + list(range(48, 48 + ub)), layout)
        before = clone(got)
        with pytest.raises(NotFound, match="checksum"):
            b.scatter_unit(view[2 * n:], list(range(ub)))
        assert b.stats()["checksum_failures"] == 1
        assert_moved(before, list(range(ub, 64)), got, list(range(ub, 64)), layout)  # nothing else touched
        with pytest.raises(LayoutError):
            b.scatter_unit(view[:n], list(range(64, 64 + ub)))
        view.release()
        b.unregister_host(addr)


@gpu
@pytest.mark.parametrize("caller_stream", ["default", "side"])
def test_async_scatter_is_ordered_on_the_callers_stream(dirs: list[Path], caller_stream: str) -> None:
    """The remote path's scatter as a retrieve's layer is: scatter_unit_async runs after the work
    queued on the caller's stream, returns while that work still runs, and the stream's later work
    sees the blocks written; scatter_wait gives each verdict (in place from registered memory, from
    a copy, and a corrupt unit's NotFound)."""
    from tutti_cluster.errors import NotFound

    kv = make_gpu_kv("kv_first", layers=2, blocks=64, seed=21)
    want = clone(kv)
    with open_gpu_store(dirs[:1], kv, "kv_first") as s:
        ub = s.unit_blocks
        assert s.store([1, 2], list(range(2 * ub))).ok
        units = [s.read_unit(k) for k in (1, 2)]
    n = len(units[0])
    arena = bytearray(units[0])
    bad = bytearray(units[1])
    bad[-100] ^= 0x01  # one bit of its last object
    got = make_gpu_kv("kv_first", layers=2, blocks=64, seed=22)
    side = torch.cuda.Stream() if caller_stream == "side" else torch.cuda.default_stream()
    with open_gpu_store(dirs[1:], got, "kv_first") as b, torch.cuda.stream(side):
        addr = b.register_host(arena)

        def scatter_three() -> tuple[list[int], int]:
            # Slots 0-2 in turn: in place from registered memory, from a copy, a corrupt copy.
            return ([b.scatter_unit_async(memoryview(arena)[:n], list(range(32, 32 + ub))),
                     b.scatter_unit_async(bytes(units[1]), list(range(32 + ub, 32 + 2 * ub)))],
                    b.scatter_unit_async(bad, list(range(ub))))

        def run(sleep_cycles: int) -> tuple[list, bool]:
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)  # keeps the current stream busy
            for l in got:
                l[:, 32:].fill_(-2.0)  # queued behind the sleep: the scatters must land after it
            tickets, bad_ticket = scatter_three()
            busy = not side.query()  # the host did not wait for the stream
            seen = [l[:, 32:32 + 2 * ub].clone() for l in got]  # queued after the scatters
            for t in tickets:
                b.scatter_wait(t)
            with pytest.raises(NotFound, match="checksum"):
                b.scatter_wait(bad_ticket)
            torch.cuda.synchronize()
            return seen, busy

        run(1000)  # once, briefly: every kernel and slot used below is loaded and allocated now
        seen, busy = run(1_000_000_000)  # about half a second of queued work
        assert busy, "scatter_unit_async waited for the caller's stream"
        b.unregister_host(addr)
    for x, w in zip(seen, want):
        assert torch.equal(_bits(x), _bits(w[:, :2 * ub])), \
            "the scatter ran before the stream's queued work, or after its later work"


@gpu
def test_corrupt_object_is_a_miss(dirs: list[Path]) -> None:
    kv = make_gpu_kv("block_first", layers=2, blocks=64, seed=6)
    with open_gpu_store(dirs[:1], kv, "block_first") as s:
        keys = list(range(1, 9))
        blocks = list(range(32))
        assert s.store(keys, blocks).ok
        g = s.geometry()
        pool = next(dirs[0].glob("tutti-*.pool"))
        with open(pool, "r+b") as f:  # flip bytes inside the first object of slot 0
            f.seek(g["header_bytes"] + 100)
            b = f.read(4)
            f.seek(g["header_bytes"] + 100)
            f.write(bytes(x ^ 0xFF for x in b))
        res = s.retrieve(keys, list(range(32, 64)))
        assert len(res.failed_units) == 1, res
        assert s.stats()["checksum_failures"] == 1
        assert s.lookup(keys) < len(keys)  # the damaged unit was dropped


def moved(before: list, want: list, src_blocks: Any, dst_blocks: Any, layout: str) -> list:
    """``before`` with block ``dst[i]`` of every object replaced by ``want``'s block ``src[i]``, for
    every i whose dst is not SKIP_BLOCK."""
    from tutti_cluster.store import SKIP_BLOCK

    out = clone(before)
    pairs = [(s, d) for s, d in zip(np.asarray(src_blocks).tolist(), np.asarray(dst_blocks).tolist()) if d != SKIP_BLOCK]
    src = torch.as_tensor([s for s, _ in pairs], device="cuda")
    dst = torch.as_tensor([d for _, d in pairs], device="cuda")
    for l in range(len(out)):
        for a, b in zip(objects(want[l], layout), objects(out[l], layout)):
            b.index_copy_(0, dst, a.index_select(0, src))
    return out


def assert_same(got: list, want: list) -> None:
    for l, (a, b) in enumerate(zip(got, want)):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(_bits(x), _bits(y)), f"layer {l} differs"


@gpu
@pytest.mark.parametrize("mapped", [False, True], ids=["io_uring", "mapped"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_skipped_blocks_are_checked_and_left_alone(shm_dirs: list[Path], dirs: list[Path], mapped: bool,
                                                   layout: str) -> None:
    """A retrieve's SKIP_BLOCK ids (the leading blocks of a unit an engine's prefix cache holds): the
    I/O kernel sums those blocks' bytes with their object and writes them nowhere, from staging and
    from mapped pool files, and on the remote path's scatter; damage inside them fails the unit."""
    from tutti_cluster.errors import NotFound
    from tutti_cluster.store import SKIP_BLOCK

    kv = make_gpu_kv(layout, layers=3, blocks=128, seed=21)
    rng = np.random.default_rng(23)
    paths = [shm_dirs[0], dirs[0]]
    with open_gpu_store(paths, kv, layout, map_memory_paths=mapped) as s:
        ub = s.unit_blocks
        keys = [int(k) for k in rng.integers(1, 1 << 62, 8)]
        n = 8 * ub - 1  # the last unit partial
        src = rng.permutation(128)[:n]
        assert s.store(keys, src).ok
        want = clone(kv)
        for trial in range(6):
            poison(kv, 0x1111 * (trial + 1))
            before = clone(kv)
            mask = rng.random(n) < (0.5 if trial % 2 else 0.2)
            mask[:ub - 1] = trial < 3  # leading blocks of the first unit, as the connector skips them
            ids = np.where(mask, SKIP_BLOCK, rng.permutation(128)[:n])
            res = s.retrieve(keys, ids)
            torch.cuda.synchronize()
            assert res.ok, res
            assert_same(kv, moved(before, want, src, ids, layout))
        data = s.read_unit(keys[0])
        poison(kv)
        before = clone(kv)
        ids = np.array([SKIP_BLOCK, SKIP_BLOCK] + list(range(100, 100 + ub - 2)))
        s.scatter_unit(data, ids)
        torch.cuda.synchronize()
        assert_same(kv, moved(before, want, src[:ub], ids, layout))
        bad = bytearray(data)
        bad[s.geometry()["header_bytes"] + 8] ^= 0x01  # object 0, in block 0: skipped
        with pytest.raises(NotFound, match="checksum"):
            s.scatter_unit(bad, ids)
        g = s.geometry()
    pool = paths[0] / "tutti-gpu.pool"  # slot 0 of the first file: the first unit
    with open(pool, "r+b") as f:
        at = g["header_bytes"] + g["obj_bytes"] + 64  # object 1, in block 0
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    with open_gpu_store(paths, kv, layout, map_memory_paths=mapped) as s:
        res = s.retrieve(keys[:1], [SKIP_BLOCK] + list(range(1, ub)))
        assert res.failed_units == [0], res
        assert s.lookup(keys[:1]) == 0


@gpu
@pytest.mark.parametrize("copy_mb", [0, 1, 512], ids=["loads", "part_staged", "staged"])
@pytest.mark.parametrize("layout", ["kv_first", "block_first", "interleaved"])
def test_mapped_memory_files(shm_dirs: list[Path], dirs: list[Path], layout: str, copy_mb: int) -> None:
    """map_memory_paths: retrieves take tmpfs pool pages through the copy engine into device memory
    (copy_engine_mb; with 1 MiB 8 units of each layer fit, the rest and all with 0 the I/O
    kernel loads over PCIe itself) and stores write them with the kernel's stores (no SQE, no
    staging), while a disk path of the same store still goes through io_uring. Units move
    byte-exact either way and across the two modes, and a corrupt mapped object is a miss."""
    paths = [shm_dirs[0], dirs[0]]
    kv = make_gpu_kv(layout, layers=3, blocks=128, block_shape=(16, 4, 64), seed=8)  # 64 KiB a unit-layer
    rng = np.random.default_rng(19)
    keys = [int(k) for k in rng.integers(1, 1 << 62, 24)]
    with open_gpu_store(paths, kv, layout, map_memory_paths=True, copy_engine_mb=copy_mb) as s:
        assert s.stats()["mapped_files"] == len(list(shm_dirs[0].glob("tutti-*.pool")))  # the disk path: never
        src = rng.permutation(128)[: 24 * s.unit_blocks]
        res = s.store(keys, src)
        assert res.ok and res.committed_units == list(range(24)), res
    want = clone(kv)
    for mapped in (False, True):  # through io_uring, then through the mapping
        poison(kv)
        with open_gpu_store(paths, kv, layout, map_memory_paths=mapped, copy_engine_mb=copy_mb) as s:
            dst = rng.permutation(128)[: 24 * s.unit_blocks]
            res = s.retrieve(keys, dst)
            torch.cuda.synchronize()
            assert res.ok, res
            assert_moved(want, src, kv, dst, layout)
            s.read_unit(keys[0])  # the CPU verifies the checksums the GPU wrote into the mapping
            # Bytes the copy engine staged: whole unit-layers (a layer's objects of a unit, 64 KiB),
            # 8 a layer in one of the two 512 KiB buffers of 1 MiB, and with 512 MiB every unit of
            # the tmpfs path (more than 8 of 24).
            g = s.geometry()
            staged, unit_layer = s.stats()["copy_engine_bytes"], g["objs_per_layer"] * g["obj_bytes"]
            assert staged % unit_layer == 0
            if not mapped or copy_mb == 0:
                assert staged == 0
            elif copy_mb == 1:
                assert staged == 3 * 8 * unit_layer, staged
            else:
                assert 3 * 8 * unit_layer < staged < 3 * 24 * unit_layer, staged
    with open_gpu_store(paths, kv, layout, map_memory_paths=True, copy_engine_mb=copy_mb) as s:
        g = s.geometry()
        pool = shm_dirs[0] / "tutti-gpu.pool"  # slot 0 of the first file: the first unit
        # The first object's last bytes: the kernel reads a mapped object in four pieces, and the
        # last piece's sum must count as much as the first's.
        at = g["header_bytes"] + g["obj_bytes"] - 64
        with open(pool, "r+b") as f:
            f.seek(at)
            b = f.read(4)
            f.seek(at)
            f.write(bytes(x ^ 0xFF for x in b))
        res = s.retrieve(keys, rng.permutation(128)[: 24 * s.unit_blocks])
        assert res.failed_units == [0], res
        assert s.lookup(keys[:1]) == 0


@gpu
@pytest.mark.parametrize("fs", ["tmpfs", "hugetlbfs"])
def test_memory_tier_mixes_mapped_and_io_uring_units_in_one_request(fs: str, shm_dirs: list[Path], dirs: list[Path],
                                                                   request: pytest.FixtureRequest) -> None:
    """The memory tier on tmpfs or hugetlbfs (mapped: the copy engine's stage for retrieves, the
    I/O kernel's stores) in front of a disk storage tier (io_uring): stores land in memory and the
    host flushes them to disk; a retrieve whose units lie in both tiers moves each byte-exact from
    its fastest copy; a unit read twice from disk is promoted and then read from memory."""
    memory = shm_dirs[0] if fs == "tmpfs" else request.getfixturevalue("hugetlbfs")
    kv = make_gpu_kv("kv_first", layers=3, blocks=256, seed=12)
    rng = np.random.default_rng(23)
    keys = [int(k) for k in rng.integers(1, 1 << 62, 24)]
    with open_gpu_store(dirs, kv, "kv_first", map_memory_paths=True, memory_paths=[str(memory)],
                        memory_capacity_gb=0.0008, copy_engine_mb=64) as s:  # 8 GPU files of 100 KiB
        mem_slots = s.stats()["memory_slots"]
        assert 4 <= mem_slots < 24
        src = rng.permutation(256)[: 24 * s.unit_blocks]
        res = s.store(keys, src)
        torch.cuda.synchronize()
        assert res.ok and res.committed_units == list(range(24)), res
        assert s.flush(timeout_s=60)
        tiers = s.unit_tiers(keys)
        assert tiers.count("both") == mem_slots and tiers.count("storage") == 24 - mem_slots
        want = clone(kv)
        poison(kv)
        dst = rng.permutation(256)[: 24 * s.unit_blocks]
        res = s.retrieve(keys, dst)
        torch.cuda.synchronize()
        assert res.ok, res
        assert_moved(want, src, kv, dst, "kv_first")
        st = s.stats()
        assert 0 < st["memory_bytes_read"] < st["bytes_read"]
        assert st["copy_engine_bytes"] == st["memory_bytes_read"]
        cold = [k for k, t in zip(keys, tiers) if t == "storage"][:2]
        blocks = dst[: 2 * s.unit_blocks]
        assert s.retrieve(cold, blocks).ok  # the second hit of each: promoted after the read
        assert s.flush(timeout_s=60)
        assert s.unit_tiers(cold) == ["both", "both"] and s.stats()["promotions"] == 2
        poison(kv)
        res = s.retrieve(keys, dst)
        torch.cuda.synchronize()
        assert res.ok, res
        assert_moved(want, src, kv, dst, "kv_first")


@gpu
@pytest.mark.slow
def test_ring_stress_millions_of_ioctxs(shm_dirs: list[Path]) -> None:
    """4 KiB objects through a small staging area: >= 2M IOCTXs, the rings wrap thousands of times."""
    layers, blocks = 8, 4096
    kv = make_gpu_kv("kv_first", layers=layers, blocks=blocks, seed=7)
    rng = np.random.default_rng(7)
    target = int(os.environ.get("TUTTI_STRESS_IOCTX", 2_000_000))
    with open_gpu_store(shm_dirs, kv, "kv_first", unit_tokens=16, staging_mb=1, capacity_gb=0.1,
                        queue_depth=128) as s:
        units = 2048
        keys = [int(k) for k in rng.integers(1, 1 << 62, units)]
        src = rng.permutation(blocks)[:units]
        assert s.store(keys, src).ok
        want = clone(kv)
        per_round = units * 2 * layers
        rounds = -(-target // per_round)
        for r in range(rounds):
            dst = rng.permutation(blocks)[:units]
            res = s.retrieve(keys, dst)
            assert res.ok, (r, res)
        torch.cuda.synchronize()
        assert_moved(want, src, kv, dst, "kv_first")
        st = s.stats()
        # With TUTTI_CUDA_PAIR=1, K and V of a unit-layer share one storage I/O: at least one agent
        # operation per two IOCTXs then, every IOCTX still through the kernel's rings and chunks.
        per_op = 2 if os.environ.get("TUTTI_CUDA_PAIR") == "1" else 1
        assert st["agent_ops"] >= rounds * per_round // per_op
        assert st["checksum_failures"] == 0 and st["io_errors"] == 0


@gpu
def test_compute_on_the_complement_partition(shm_dirs: list[Path]) -> None:
    """A matrix product on the complement stream while a large retrieve runs: both are right."""
    kv = make_gpu_kv("kv_first", layers=8, blocks=4096, seed=8)  # 8 layers x 4096 x 8 KiB = 256 MiB
    rng = np.random.default_rng(8)
    with open_gpu_store(shm_dirs, kv, "kv_first", capacity_gb=1.0, unit_tokens=256, staging_mb=32) as s:
        h = s.compute_stream()
        assert h != 0, "no complement partition (green contexts unavailable?)"
        ub = s.unit_blocks
        n = 4096 // ub
        keys = [int(k) for k in rng.integers(1, 1 << 62, n)]
        src = rng.permutation(4096)
        assert s.store(keys, src).ok
        want = clone(kv)
        poison(kv)
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        ref = (a.float() @ a.float()).to(torch.bfloat16)
        torch.cuda.synchronize()
        compute = torch.cuda.ExternalStream(h)
        dst = rng.permutation(4096)
        req = s.begin_retrieve(keys, dst)
        for layer in range(8):
            s.retrieve_layer(layer, req)
        outs = []
        with torch.cuda.stream(compute):
            for _ in range(20):
                outs.append(a @ a)
        res = s.finish(req)
        compute.synchronize()
        torch.cuda.synchronize()
        assert res.ok, res
        assert_moved(want, src, kv, dst, "kv_first")
        for o in outs:
            err = (o.float() - ref.float()).norm() / ref.float().norm()
            assert err < 1e-2


# ---- two processes on two GPUs -------------------------------------------------------------------


def _worker(device: int, mapped: bool, paths: list[str]) -> dict[str, Any]:
    """One GPU process: its own store instance and queues (or registered mappings) on the shared paths."""
    torch.cuda.set_device(device)
    kv = make_gpu_kv("kv_first", layers=8, blocks=2048, seed=device)
    rng = np.random.default_rng(device)
    s = TuttiStore(TuttiConfig(paths=paths, capacity_gb=1.0, unit_tokens=256, staging_mb=32, backend="cuda",
                               device=device, instance=f"gpu{device}", map_memory_paths=mapped))
    s.register_kv_caches([t for t in kv], block_tokens=16, layout="kv_first")
    n = 2048 // s.unit_blocks
    keys = [int(k) for k in rng.integers(1, 1 << 62, n)]
    src = rng.permutation(2048)
    assert s.store(keys, src).ok
    want = clone(kv)
    poison(kv)
    dst = rng.permutation(2048)
    res = s.retrieve(keys, dst)
    torch.cuda.synchronize()
    assert res.ok, res
    assert_moved(want, src, kv, dst, "kv_first")
    st = s.stats()
    s.close()
    return {"device": device, "units": n, "bytes_read": st["bytes_read"], "backend": st["backend"],
            "mapped_files": st["mapped_files"],
            "pool_files": sum(len(list(Path(d).glob(f"tutti-gpu{device}*.pool"))) for d in paths)}


@gpu
@pytest.mark.skipif(not HAVE_GPU or torch.cuda.device_count() < 2, reason="needs two GPUs in one host")
@pytest.mark.parametrize("mapped", [False, True], ids=["io_uring", "mapped"])
def test_two_processes_two_gpus(shm_dirs: list[Path], mapped: bool) -> None:
    paths = [str(d) for d in shm_dirs]
    procs = [
        subprocess.Popen([sys.executable, __file__, "worker", str(dev), str(int(mapped)), *paths], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=str(Path(__file__).parent))
        for dev in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert sorted(r["device"] for r in results) == [0, 1]
    # Each process owns its share of every path: several pool files each on tmpfs, all of them mapped
    # when asked.
    assert all(r["pool_files"] > len(shm_dirs) for r in results)
    assert all(r["mapped_files"] == (r["pool_files"] if mapped else 0) for r in results)
    for d in shm_dirs:
        assert {p.name.split(".")[0] for p in d.glob("tutti-*.pool")} == {"tutti-gpu0", "tutti-gpu1"}


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    print(json.dumps(_worker(int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4:])))

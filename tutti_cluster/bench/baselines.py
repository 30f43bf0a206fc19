"""Baselines run beside tutti in the same benchmark, on the same paths and KV tensors.

* ``per-block`` - the vLLM file-offload pattern (vLLM's OffloadingConnector with a file-system
  medium, as llm-d's fs backend does it): one file per KV block holding that block for every
  layer, K and V (``[layers, 2, block_tokens, kv_heads, head_size]``, 2 MiB for Llama-3-8B); a
  thread pool; each job opens, reads or writes, and closes one file through a per-thread staging
  buffer and makes one copy between that buffer and the block in the KV tensors.
* ``per-chunk`` - the LMCache local-disk pattern: one file per 256-token chunk holding all layers
  in LMCache's ``KV_2LTD`` order (``[2, layers, tokens, kv_heads * head_size]``, 32 MiB); a
  thread pool; each job reads the whole chunk into a staging buffer and scatters it into the
  chunk's 16 blocks with one indexed copy (or gathers and writes for a store).
* ``kvikio`` (CUDA only) - RAPIDS kvikio in POSIX (compatibility) mode reading the per-block
  files one 32 KiB object at a time straight into the KV blocks in GPU memory.

The baselines use ordinary buffered files, as those systems do.  A store ends with syncfs(2) on
each path, so that its data has reached the device as tutti's O_DIRECT writes have; before a
read pass their files are evicted from the page cache (POSIX_FADV_DONTNEED).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tutti_cluster.bench import fsutil
from tutti_cluster.bench.common import OpTiming, Round
from tutti_cluster.bench.kvdata import KVData

logger = logging.getLogger(__name__)

CHUNK_TOKENS = 256


class _FileBaseline:
    """Shared machinery: a thread pool with per-thread staging, file naming over the paths."""

    name = ""
    ops: tuple[str, ...] = ("store", "retrieve")
    suffix = ""

    def __init__(self, kv: KVData, dirs: Sequence[Path], threads: int, staging_bytes: int) -> None:
        self.kv = kv
        self.dirs = list(dirs)
        self.threads = threads
        self._staging_bytes = staging_bytes
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"bench-{self.name}")
        self._files: list[Path] = []
        self._cuda = kv.device.type == "cuda"
        self._warm = False

    def _path(self, rnd: Round, index: int) -> Path:
        return self.dirs[index % len(self.dirs)] / f"{self.name}-{rnd.tag}-{index}.{self.suffix}"

    def _staging(self) -> torch.Tensor:
        """This worker thread's staging buffer (pinned when the KV cache is on a GPU)."""
        st = getattr(self._local, "staging", None)
        if st is None:
            st = torch.empty(self._staging_bytes, dtype=torch.uint8, pin_memory=self._cuda)
            self._local.staging = st
            if self._cuda:
                self._local.stream = torch.cuda.Stream(self.kv.device)
        return st

    def prepare(self, rnd: Round) -> None:
        if not self._warm:
            self._warm_threads()
            self._warm = True

    def _warm_threads(self) -> None:
        """Give every pool thread its staging now: pinned allocations are slow and must not land
        in a timed pass."""
        barrier = threading.Barrier(self.threads)

        def job() -> None:
            self._staging()
            self._warm_thread()
            barrier.wait()  # holds this thread, so that every job lands on a different one

        for fut in [self._pool.submit(job) for _ in range(self.threads)]:
            fut.result()

    def _warm_thread(self) -> None:
        """Per-thread setup beyond the host staging buffer (none by default)."""

    def _run(self, jobs: Sequence[Callable[[], None]]) -> OpTiming:
        """Submit ``jobs`` from this (engine) thread, wait for all; re-raise the first failure."""
        t0 = time.thread_time()
        futures: list[Future[None]] = [self._pool.submit(job) for job in jobs]
        engine_cpu = time.thread_time() - t0
        for fut in futures:
            fut.result()
        return OpTiming(engine_cpu_s=engine_cpu)

    def _sync_paths(self) -> None:
        for d in self.dirs:
            fsutil.syncfs(d)

    def before_read(self, rnd: Round) -> None:
        fsutil.evict(self._files)

    def end_round(self, rnd: Round) -> None:
        for p in self._files:
            p.unlink(missing_ok=True)
        self._files = []

    def release(self) -> None:
        """Nothing stays between rounds: each round's files go in end_round."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.end_round(None)  # type: ignore[arg-type]


def _bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor (for readv/writev)."""
    arr: Any = t.numpy()
    return memoryview(arr)


def _write_file(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fsutil.write_all(fd, data)
    finally:
        os.close(fd)


def _read_file(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        fsutil.read_all(fd, data)
    finally:
        os.close(fd)


class PerBlockBaseline(_FileBaseline):
    """One file per block (all layers, K and V), a thread pool, one copy per block."""

    name = "per-block"
    suffix = "blk"

    def __init__(self, kv: KVData, dirs: Sequence[Path], threads: int) -> None:
        super().__init__(kv, dirs, threads, kv.shape.block_bytes)
        s = kv.shape
        self._block_shape = (s.layers, 2, s.block_tokens, s.kv_heads, s.head_size)

    def _typed(self, st: torch.Tensor) -> torch.Tensor:
        return st.view(self.kv.shape.dtype).view(self._block_shape)

    def _store_one(self, path: Path, block: int) -> None:
        st = self._staging()
        src = self.kv.all[:, :, block]
        if self._cuda:
            with torch.cuda.stream(self._local.stream):
                self._typed(st).copy_(src)
        else:
            self._typed(st).copy_(src)
        _write_file(path, _bytes(st))

    def _load_one(self, path: Path, block: int) -> None:
        st = self._staging()
        _read_file(path, _bytes(st))
        dst = self.kv.all[:, :, block]
        if self._cuda:
            with torch.cuda.stream(self._local.stream):
                dst.copy_(self._typed(st))
        else:
            dst.copy_(self._typed(st))

    def store(self, rnd: Round) -> OpTiming:
        ids = rnd.store_ids.tolist()
        self._files = [self._path(rnd, i) for i in range(rnd.n_blocks)]
        jobs = [lambda p=p, b=b: self._store_one(p, b) for p, b in zip(self._files, ids)]
        timing = self._run(jobs)
        self._sync_paths()
        return timing

    def retrieve(self, rnd: Round) -> OpTiming:
        ids = rnd.retrieve_ids.tolist()
        jobs = [lambda p=p, b=b: self._load_one(p, b) for p, b in zip(self._files, ids)]
        return self._run(jobs)

    def object_offset(self, layer: int, kv: int) -> int:
        """Byte offset of a layer's K (kv=0) or V (kv=1) object inside a block file."""
        return (2 * layer + kv) * self.kv.shape.object_bytes

    @property
    def files(self) -> list[Path]:
        return list(self._files)


class PerChunkBaseline(_FileBaseline):
    """256-token chunk files (all layers), a thread pool, staging plus one scatter per chunk."""

    name = "per-chunk"
    suffix = "chunk"

    def __init__(self, kv: KVData, dirs: Sequence[Path], threads: int) -> None:
        s = kv.shape
        self.chunk_blocks = CHUNK_TOKENS // s.block_tokens
        super().__init__(kv, dirs, threads, self.chunk_blocks * s.block_bytes)
        # KV_2LTD, with the token axis split into (blocks, block_tokens).
        self._chunk_shape = (2, s.layers, self.chunk_blocks, s.block_tokens, s.kv_heads, s.head_size)

    def _typed(self, st: torch.Tensor) -> torch.Tensor:
        return st.view(self.kv.shape.dtype).view(self._chunk_shape)

    def _warm_thread(self) -> None:
        if self._cuda:
            self._device_staging()

    def _device_staging(self) -> torch.Tensor:
        gst = getattr(self._local, "device_staging", None)
        if gst is None:
            gst = torch.empty(self._chunk_shape, dtype=self.kv.shape.dtype, device=self.kv.device)
            self._local.device_staging = gst
        return gst

    def _store_one(self, path: Path, ids: torch.Tensor) -> None:
        st = self._staging()
        if self._cuda:
            with torch.cuda.stream(self._local.stream):
                gathered = self.kv.all.index_select(2, ids)
                self._typed(st).copy_(gathered.transpose(0, 1))
        else:
            self._typed(st).copy_(self.kv.all.index_select(2, ids).transpose(0, 1))
        _write_file(path, _bytes(st))

    def _load_one(self, path: Path, ids: torch.Tensor) -> None:
        st = self._staging()
        _read_file(path, _bytes(st))
        if self._cuda:
            with torch.cuda.stream(self._local.stream):
                gst = self._device_staging()
                gst.copy_(self._typed(st), non_blocking=True)
                self.kv.all.index_copy_(2, ids, gst.transpose(0, 1))
                self._local.stream.synchronize()
        else:
            self.kv.all.index_copy_(2, ids, self._typed(st).transpose(0, 1))

    def _chunks(self, ids: torch.Tensor) -> list[torch.Tensor]:
        if ids.numel() % self.chunk_blocks:
            raise ValueError(f"a prefix of {ids.numel()} blocks is not a whole number of {CHUNK_TOKENS}-token chunks")
        ids = ids.to(self.kv.device)
        return list(ids.view(-1, self.chunk_blocks).unbind(0))

    def store(self, rnd: Round) -> OpTiming:
        chunks = self._chunks(rnd.store_ids)
        self._files = [self._path(rnd, c) for c in range(len(chunks))]
        jobs = [lambda p=p, c=c: self._store_one(p, c) for p, c in zip(self._files, chunks)]
        timing = self._run(jobs)
        self._sync_paths()
        return timing

    def retrieve(self, rnd: Round) -> OpTiming:
        chunks = self._chunks(rnd.retrieve_ids)
        jobs = [lambda p=p, c=c: self._load_one(p, c) for p, c in zip(self._files, chunks)]
        return self._run(jobs)


def import_kvikio(threads: int) -> Any:
    """Import kvikio in POSIX (compatibility) mode with ``threads`` I/O threads.

    Raises ImportError with the reason when kvikio is not usable here.
    """
    # kvikio reads its settings from the environment when it is first imported.
    os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
    os.environ.setdefault("KVIKIO_NTHREADS", str(threads))
    import kvikio  # type: ignore[import-not-found]

    return kvikio


class KvikioBaseline:
    """kvikio (POSIX mode) reading the per-block files, one 32 KiB object per read, into GPU memory.

    Storing is not measured: the data is written by the per-block baseline (untimed here).
    """

    name = "kvikio"
    ops: tuple[str, ...] = ("retrieve",)
    _open_window = 256  # files open at once, so a 128K-token prefix stays below fd limits

    def __init__(self, kv: KVData, dirs: Sequence[Path], threads: int) -> None:
        if kv.device.type != "cuda":
            raise ImportError("kvikio reads into GPU memory; the KV cache is on the CPU")
        self._kvikio = import_kvikio(threads)
        self.kv = kv
        self._writer = PerBlockBaseline(kv, dirs, threads)
        self._writer.name = "kvikio"
        self._scratch = torch.empty(kv.shape.object_bytes // 2, dtype=torch.int16, device=kv.device)

    def prepare(self, rnd: Round) -> None:
        self._writer.prepare(rnd)

    def store(self, rnd: Round) -> OpTiming:
        return self._writer.store(rnd)

    def before_read(self, rnd: Round) -> None:
        # One read into scratch memory first: kvikio sets up its thread pool and bounce buffers
        # on first use, which must not land in the timed pass.
        f = self._kvikio.CuFile(str(self._writer.files[0]), "r")
        try:
            f.pread(self._scratch, file_offset=0).get()
        finally:
            f.close()
        self._writer.before_read(rnd)

    def retrieve(self, rnd: Round) -> OpTiming:
        # torch exports no __cuda_array_interface__ for bf16: read through an int16 view.
        view = self.kv.all.view(torch.int16)
        layers = self.kv.shape.layers
        engine_cpu = 0.0
        pending: list[tuple[Any, list[Any]]] = []

        def drain(keep: int) -> None:
            while len(pending) > keep:
                f, futs = pending.pop(0)
                for fut in futs:
                    fut.get()
                f.close()

        for path, block in zip(self._writer.files, rnd.retrieve_ids.tolist()):
            t0 = time.thread_time()
            f = self._kvikio.CuFile(str(path), "r")
            futs = [
                f.pread(view[layer, k, block], file_offset=self._writer.object_offset(layer, k))
                for layer in range(layers)
                for k in (0, 1)
            ]
            engine_cpu += time.thread_time() - t0
            pending.append((f, futs))
            drain(self._open_window)
        drain(0)
        torch.cuda.synchronize(self.kv.device)
        return OpTiming(engine_cpu_s=engine_cpu)

    def end_round(self, rnd: Round) -> None:
        self._writer.end_round(rnd)

    def release(self) -> None:
        self._writer.release()

    def close(self) -> None:
        self._writer.close()


class LayerwisePerChunk(PerChunkBaseline):
    """The per-chunk files read one layer at a time, as LMCache's layer-wise mode reads its disk
    backend: per layer and chunk, one job reads the layer's K and V ranges of the chunk file
    (``KV_2LTD``: each is contiguous) into its staging buffer and scatters them into the chunk's
    blocks; ``wait_layer`` waits for the layer's jobs (the engine thread blocks, as it does there).

    For the pipeline harness: ``kv`` is any object with the ``shape``, ``device`` and ``all``
    (``[layers, 2, blocks, ...]``) of :class:`KVData`.
    """

    name = "per-chunk-lw"

    def __init__(self, kv: KVData, dirs: Sequence[Path], threads: int) -> None:
        super().__init__(kv, dirs, threads)
        s = kv.shape
        self._layer_bytes = self.chunk_blocks * s.object_bytes  # one layer's K (or V) of a chunk
        self._round: Round | None = None
        self._chunks_now: list[torch.Tensor] = []
        self._pending: dict[int, list[Future[None]]] = {}

    def store_prefix(self, block_ids: torch.Tensor) -> None:
        """Writes the chunk files of a prefix held in ``block_ids`` (untimed setup)."""
        n = int(block_ids.numel())
        self._round = Round(n * self.kv.shape.block_tokens, n, block_ids, block_ids, tag="lw")
        self.prepare(self._round)
        self.store(self._round)

    def begin(self, block_ids: torch.Tensor) -> None:
        """Starts a request: the first ``len(block_ids)`` blocks' chunks land in ``block_ids``."""
        if self._round is None:
            raise ValueError("store_prefix() first")
        if block_ids.numel() > self._round.n_blocks:
            raise ValueError(f"{block_ids.numel()} blocks requested, {self._round.n_blocks} stored")
        self._chunks_now = self._chunks(block_ids)
        self._pending = {}

    def _load_layer(self, path: Path, ids: torch.Tensor, layer: int) -> None:
        st = self._staging()
        lb, layers = self._layer_bytes, self.kv.shape.layers
        buf = _bytes(st)
        fd = os.open(path, os.O_RDONLY)
        try:
            for kv in (0, 1):
                fsutil.read_all(fd, buf[kv * lb : (kv + 1) * lb], offset=(kv * layers + layer) * lb)
        finally:
            os.close(fd)
        s = self.kv.shape
        src = st[: 2 * lb].view(s.dtype).view(2, self.chunk_blocks, s.block_tokens, s.kv_heads, s.head_size)
        dst = self.kv.all[layer]
        if self._cuda:
            with torch.cuda.stream(self._local.stream):
                gst = self._device_staging()[:, 0]  # [2, chunk_blocks, ...] of this thread
                gst.copy_(src, non_blocking=True)
                dst.index_copy_(1, ids, gst)
                self._local.stream.synchronize()
        else:
            dst.index_copy_(1, ids, src)

    def retrieve_layer(self, layer: int) -> None:
        self._pending[layer] = [self._pool.submit(self._load_layer, self._files[c], ids, layer)
                                for c, ids in enumerate(self._chunks_now)]

    def wait_layer(self, layer: int) -> None:
        for fut in self._pending.pop(layer, []):
            fut.result()

    def remove_files(self) -> None:
        self.end_round(None)  # type: ignore[arg-type]
        self._round = None

"""Same-run hardware limits: storage read and write bandwidth on the configured paths,
host-to-GPU copy bandwidth when a GPU is used, and host memory copy bandwidth
(:func:`host_copy_sweep`, for the memory tier in ``tutti bench tiers`` and
``tutti bench vllm``).

Storage is measured the way a perfect data path would use it: large sequential requests (1 MiB)
from several threads at once (the best of several thread counts wins), with O_DIRECT where the file
system accepts it, into an aligned host buffer as large as the store's staging area (pinned on
CUDA).  Each path holds several files (``FILES_PER_PATH``), walked in step, so that concurrent
requests go to different files: on tmpfs, writes to one file serialise on its inode lock, which
would measure the lock rather than the storage.  Reading into one small reused buffer would stay in the CPU cache
and overstate the limit, so every request of a pass lands in its own slot of the large buffer,
cycling only when the buffer is exhausted.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tutti_cluster.bench import fsutil

logger = logging.getLogger(__name__)

REQUEST_BYTES = 1 << 20
FILES_PER_PATH = 16


@dataclass
class Limits:
    """Measured limits (GB/s, 1e9 bytes per second) and how they were measured."""

    storage_read_gbps: float
    storage_write_gbps: float
    h2d_gbps: float | None
    read_by_threads: dict[int, float] = field(default_factory=dict)
    write_by_threads: dict[int, float] = field(default_factory=dict)
    file_bytes: int = 0
    buffer_bytes: int = 0
    direct_io: dict[str, bool] = field(default_factory=dict)

    def as_json(self) -> dict[str, float]:
        """The ``limits`` object of the benchmark's JSON."""
        out = {"storage_read_gbps": self.storage_read_gbps, "storage_write_gbps": self.storage_write_gbps}
        if self.h2d_gbps is not None:
            out["h2d_gbps"] = self.h2d_gbps
        return out


def timed_threads(n: int, work: Callable[[int], None]) -> float:
    """Runs ``work(0)`` .. ``work(n - 1)`` on ``n`` threads released together; returns the seconds
    from their release to the last one's end, and re-raises the first error in the caller's thread."""
    errors: list[BaseException] = []
    start = threading.Barrier(n + 1)

    def run(t: int) -> None:
        try:
            start.wait()
            work(t)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    pool = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(n)]
    for th in pool:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in pool:
        th.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def _run_pass(fds: Sequence[int], nbytes: int, buf: memoryview, threads: int, write: bool,
              request: int = REQUEST_BYTES) -> float:
    """One pass of ``nbytes`` (whole requests of ``request`` bytes) over the files with ``threads``
    threads; returns GB/s."""
    total = max(1, nbytes // request)
    slots = len(buf) // request

    def worker(t: int) -> None:
        for k in range(t, total, threads):
            # Request k: file k % n at offset (k // n) requests, so the files are walked in step.
            fd = fds[k % len(fds)]
            off = (k // len(fds)) * request
            slot = buf[(k % slots) * request : (k % slots + 1) * request]
            if write:
                fsutil.write_all(fd, slot, off)
            else:
                fsutil.read_all(fd, slot, off)

    elapsed = timed_threads(threads, worker)
    if write:
        t0 = time.perf_counter()
        for fd in fds:
            os.fdatasync(fd)
        elapsed += time.perf_counter() - t0
    return total * request / elapsed / 1e9


class StorageProbe:
    """The limit's files on ``dirs``, kept for the whole run.

    ``sweep`` measures write then read limits at every thread count (and host-to-GPU on CUDA);
    ``read_pass``/``write_pass`` measure once more, with the thread count that won the sweep, right
    beside a system's timed pass: a shared virtual disk's speed drifts by half within minutes, and
    only a limit measured next to the pass it is compared with cancels that drift.
    Those passes move as many bytes as the pass they are compared with (``nbytes``): a virtual
    disk's host may cache recent writes, and a limit that reads back a smaller, fresher working set
    than the system under test would be served from that cache.
    ``total_bytes`` (at least the largest pass) is spread over ``FILES_PER_PATH`` files per
    directory, which ``close`` removes.  Writes go to files that were fully written once already,
    so that no pass pays for first allocation of extents (on memory file systems, also read once).
    Passes move 1 MiB requests; ``write_pass`` takes larger ones, up to ``max_request_bytes``, for a
    system that writes larger ones (a limit must be measured with the requests the system under test
    may use).
    """

    def __init__(
        self,
        dirs: Sequence[Path],
        direct_io: dict[Path, bool],
        total_bytes: int,
        buffer_bytes: int,
        device: torch.device,
        max_request_bytes: int = REQUEST_BYTES,
    ) -> None:
        n_files = len(dirs) * FILES_PER_PATH
        rq = self._max_request = max(REQUEST_BYTES, max_request_bytes) // REQUEST_BYTES * REQUEST_BYTES
        per_file = max(rq, total_bytes // n_files // rq * rq)
        self.device = device
        self._buf = fsutil.aligned_buffer(max(buffer_bytes, 64 * REQUEST_BYTES, 16 * rq))
        self._pinned = fsutil.PinnedRegion(self._buf) if device.type == "cuda" else None
        # Incompressible, non-zero contents for the write passes.
        self._view = memoryview(self._buf)
        self._view[:REQUEST_BYTES] = os.urandom(REQUEST_BYTES)
        for off in range(REQUEST_BYTES, len(self._buf), REQUEST_BYTES):
            self._view[off : off + REQUEST_BYTES] = self._view[:REQUEST_BYTES]
        # File j lives on path j % len(dirs), so that consecutive requests also alternate paths.
        self._owners = [dirs[j % len(dirs)] for j in range(n_files)]
        self._paths = [d / f"storage-limit-{j}.dat" for j, d in enumerate(self._owners)]
        self._direct = direct_io
        self._fds: list[int] = []
        self.limits = Limits(
            0.0, 0.0, None, file_bytes=per_file * n_files, buffer_bytes=len(self._buf),
            direct_io={str(d): direct_io[d] for d in dirs},
        )
        try:
            for d, p in zip(self._owners, self._paths):
                fd = os.open(p, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct_io[d] else 0), 0o600)
                self._fds.append(fd)
                os.posix_fallocate(fd, 0, per_file)
            _run_pass(self._fds, self.limits.file_bytes, self._view, 16, write=True, request=rq)
            if any(fsutil.fs_type(d) in fsutil.MEMORY_FS for d in dirs):
                # On tmpfs, pages written only once are slow to pass over again: on the H200 host
                # a 16 GiB pass, of which the sweep had touched only 4 GiB, wrote and read at
                # 21 GB/s against 33 in later rounds. So every page is read once too.
                _run_pass(self._fds, self.limits.file_bytes, self._view, 16, write=False, request=rq)
        except BaseException:
            self.close()
            raise

    def _pass(self, threads: int, write: bool, nbytes: int, request: int = REQUEST_BYTES) -> float:
        if request % REQUEST_BYTES or not REQUEST_BYTES <= request <= self._max_request:
            raise ValueError(f"request of {request} bytes: whole MiB up to {self._max_request}")
        if not write:
            # Buffered paths other than tmpfs would be read from the page cache: evict first.
            fsutil.evict(p for d, p in zip(self._owners, self._paths) if not self._direct[d])
        return _run_pass(self._fds, min(nbytes, self.limits.file_bytes), self._view, threads, write, request)

    def sweep(
        self, thread_counts: Sequence[int], nbytes: int, on_step: Callable[[str], None] = lambda _s: None
    ) -> Limits:
        """Write then read passes of ``nbytes`` at every thread count; the best of each is the limit."""
        lim = self.limits
        for t in thread_counts:
            on_step(f"storage limit: write, {t} threads")
            lim.write_by_threads[t] = self._pass(t, True, nbytes)
        for t in thread_counts:
            on_step(f"storage limit: read, {t} threads")
            lim.read_by_threads[t] = self._pass(t, False, nbytes)
        lim.storage_write_gbps = max(lim.write_by_threads.values())
        lim.storage_read_gbps = max(lim.read_by_threads.values())
        if self.device.type == "cuda":
            on_step("host-to-GPU limit")
            lim.h2d_gbps = measure_h2d(self._buf, self.device)
        return lim

    def write_pass(self, nbytes: int, threads: int | None = None, request: int = REQUEST_BYTES) -> float:
        """One write pass of ``nbytes`` (GB/s), with the sweep's best thread count unless given."""
        by = self.limits.write_by_threads
        return self._pass(threads or max(by, key=by.__getitem__), True, nbytes, request)

    def read_pass(self, nbytes: int) -> float:
        """One read pass of ``nbytes`` with the sweep's best thread count (GB/s)."""
        by = self.limits.read_by_threads
        return self._pass(max(by, key=by.__getitem__), False, nbytes)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        for p in self._paths:
            p.unlink(missing_ok=True)
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
        self._view.release()
        self._buf.close()


def flush_shape(unit_bytes: int) -> tuple[int, int]:
    """The memory tier's flush as the disk sees it (``kFlushCopiers`` units at once, each one's
    objects in ``kFlushParts`` writes: unit_store.h): the writes in flight, and the bytes of each in
    whole MiB."""
    from tutti_cluster import _native

    part = max(REQUEST_BYTES, unit_bytes // _native.FLUSH_PARTS // REQUEST_BYTES * REQUEST_BYTES)
    return _native.FLUSH_COPIERS * _native.FLUSH_PARTS, part


def measure_h2d(buf: mmap.mmap, device: torch.device, repeats: int = 5) -> float:
    """Bulk copies from the pinned buffer to GPU memory (up to 1 GiB each); returns GB/s."""
    nbytes = min(len(buf), 1 << 30)
    src = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    del src, dst
    return repeats * nbytes / elapsed / 1e9


def host_copy_gbps(threads: int, buf_bytes: int = 64 << 20, rounds: int = 4) -> float:
    """Host memory copy bandwidth: each of ``threads`` threads copies its own ``buf_bytes`` buffer
    into another, ``rounds`` times (numpy copies release the GIL); GB/s copied (each byte read once
    and written once). The pages are touched before the timed copies."""
    pairs = [(np.ones(buf_bytes, np.uint8), np.full(buf_bytes, 2, np.uint8)) for _ in range(threads)]

    def work(t: int) -> None:
        for _ in range(rounds):
            np.copyto(pairs[t][1], pairs[t][0])

    return threads * rounds * buf_bytes / timed_threads(threads, work) / 1e9


def host_copy_sweep(buf_bytes: Callable[[int], int], rounds: int = 4) -> dict[int, float]:
    """:func:`host_copy_gbps` with one thread and with every core (up to 16), each thread copying
    ``buf_bytes(threads)`` bytes: GB/s by thread count (a limit takes the best)."""
    cores = min(os.cpu_count() or 1, 16)
    return {t: host_copy_gbps(t, buf_bytes(t), rounds) for t in sorted({1, cores})}

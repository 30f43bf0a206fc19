"""Same-run hardware limits: storage read and write bandwidth on the configured paths, and
host-to-GPU copy bandwidth when a GPU is used.

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


def _run_pass(fds: Sequence[int], file_bytes: int, buf: memoryview, threads: int, write: bool) -> float:
    """One pass of 1 MiB requests over all files with ``threads`` threads; returns GB/s."""
    per_file = file_bytes // REQUEST_BYTES
    total = per_file * len(fds)
    slots = len(buf) // REQUEST_BYTES
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def worker(t: int) -> None:
        try:
            start.wait()
            for k in range(t, total, threads):
                # Request k: file k % n at offset (k // n) MiB, so the files are walked in step.
                fd = fds[k % len(fds)]
                off = (k // len(fds)) * REQUEST_BYTES
                slot = buf[(k % slots) * REQUEST_BYTES : (k % slots + 1) * REQUEST_BYTES]
                if write:
                    fsutil.write_all(fd, slot, off)
                else:
                    fsutil.read_all(fd, slot, off)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
    for th in pool:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in pool:
        th.join()
    if write:
        for fd in fds:
            os.fdatasync(fd)
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return total * REQUEST_BYTES / elapsed / 1e9


def measure_storage(
    dirs: Sequence[Path],
    direct_io: dict[Path, bool],
    total_bytes: int,
    thread_counts: Sequence[int],
    buffer_bytes: int,
    device: torch.device,
    on_step: Callable[[str], None] = lambda _s: None,
) -> Limits:
    """Measure storage write then read limits on ``dirs``, then host-to-GPU when on CUDA.

    ``total_bytes`` is spread over ``FILES_PER_PATH`` files per directory; they are removed
    afterwards.
    Writes go to files that were fully written once already, so that no pass pays for first
    allocation of extents.
    """
    n_files = len(dirs) * FILES_PER_PATH
    per_file = max(REQUEST_BYTES, total_bytes // n_files // REQUEST_BYTES * REQUEST_BYTES)
    buffer_bytes = max(buffer_bytes, max(thread_counts) * REQUEST_BYTES)
    buf = fsutil.aligned_buffer(buffer_bytes)
    pinned = fsutil.PinnedRegion(buf) if device.type == "cuda" else None
    # Incompressible, non-zero contents for the write passes.
    view = memoryview(buf)
    view[:REQUEST_BYTES] = os.urandom(REQUEST_BYTES)
    for off in range(REQUEST_BYTES, len(buf), REQUEST_BYTES):
        view[off : off + REQUEST_BYTES] = view[:REQUEST_BYTES]
    # File j lives on path j % len(dirs), so that consecutive requests also alternate paths.
    owners = [dirs[j % len(dirs)] for j in range(n_files)]
    paths = [d / f"storage-limit-{j}.dat" for j, d in enumerate(owners)]
    fds: list[int] = []
    limits = Limits(0.0, 0.0, None, file_bytes=per_file * n_files, buffer_bytes=len(buf))
    try:
        for d, p in zip(owners, paths):
            flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct_io[d] else 0)
            fd = os.open(p, flags, 0o600)
            fds.append(fd)
            os.posix_fallocate(fd, 0, per_file)
            limits.direct_io[str(d)] = direct_io[d]
        on_step("storage limit: first write")
        _run_pass(fds, per_file, view, max(thread_counts), write=True)
        for t in thread_counts:
            on_step(f"storage limit: write, {t} threads")
            limits.write_by_threads[t] = _run_pass(fds, per_file, view, t, write=True)
        for t in thread_counts:
            # Buffered paths other than tmpfs would be read from the page cache: evict first.
            fsutil.evict(p for d, p in zip(owners, paths) if not direct_io[d])
            on_step(f"storage limit: read, {t} threads")
            limits.read_by_threads[t] = _run_pass(fds, per_file, view, t, write=False)
        limits.storage_write_gbps = max(limits.write_by_threads.values())
        limits.storage_read_gbps = max(limits.read_by_threads.values())
        if device.type == "cuda":
            on_step("host-to-GPU limit")
            limits.h2d_gbps = _measure_h2d(buf, device)
    finally:
        for fd in fds:
            os.close(fd)
        for p in paths:
            p.unlink(missing_ok=True)
        del view
        if pinned is not None:
            pinned.close()
        buf.close()
    return limits


def _measure_h2d(buf: mmap.mmap, device: torch.device, repeats: int = 5) -> float:
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

"""File-system helpers for the benchmark: file-system types, O_DIRECT probing, page-cache control,
aligned (and, on CUDA, pinned) host buffers. PyTorch is imported only by :class:`PinnedRegion`."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from pathlib import Path
from typing import Iterable

logger = logging.getLogger(__name__)

ALIGN = 4096
_libc = ctypes.CDLL(None, use_errno=True)


MEMORY_FS = ("tmpfs", "ramfs")
MEMORY_TIER_FS = (*MEMORY_FS, "hugetlbfs")  # what a memory tier may live on (the store maps hugetlbfs)


def check_memory_tier_dirs(dirs: Iterable[str | os.PathLike[str]]) -> None:
    """ConfigError unless each directory is one on a file system the memory tier takes."""
    from tutti_cluster.errors import ConfigError

    for d in dirs:
        fs = fs_type(d) if os.path.isdir(d) else None
        if fs not in MEMORY_TIER_FS:
            raise ConfigError(f"memory path {d} is {'on ' + fs if fs else 'not a directory'}; the memory tier "
                              "needs tmpfs, ramfs or hugetlbfs")


def fs_type(path: str | os.PathLike[str]) -> str:
    """File-system type of the mount holding ``path`` (from /proc/self/mounts), or "unknown"."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, fields[2]
    except OSError:
        pass
    return kind


def probe_direct_io(directory: Path) -> bool:
    """Whether ``directory``'s file system accepts aligned O_DIRECT writes and reads.

    tmpfs refuses O_DIRECT with EINVAL on many kernels; the benchmark then uses buffered I/O
    there and says so.
    """
    probe = directory / ".direct-io-probe"
    buf = aligned_buffer(ALIGN)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        os.pwritev(fd, [buf], 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
        buf.close()


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory of ``nbytes`` (rounded up to 4 KiB), populated now."""
    size = -(-nbytes // ALIGN) * ALIGN
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, size, flags=flags)


def buffer_address(buf: mmap.mmap) -> int:
    """Address of an mmap buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class PinnedRegion:
    """Registers an mmap buffer with CUDA as pinned (page-locked) host memory for its lifetime.

    Allocating with mmap and registering keeps the memory usable for O_DIRECT and io_uring on
    every kernel, which cudaHostAlloc memory is not.
    """

    def __init__(self, buf: mmap.mmap) -> None:
        import torch

        self._ptr = buffer_address(buf)
        rc = torch.cuda.cudart().cudaHostRegister(self._ptr, len(buf), 0)
        if int(rc) != 0:
            from tutti_cluster.errors import DeviceError

            raise DeviceError(f"cudaHostRegister of {len(buf)} bytes failed (error {int(rc)})")

    def close(self) -> None:
        if self._ptr:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self._ptr = 0


def syncfs(directory: Path) -> None:
    """Flush the dirty pages of the file system holding ``directory`` (syncfs(2))."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(directory))
    finally:
        os.close(fd)


def evict(files: Iterable[Path]) -> None:
    """Drop the (clean) cached pages of ``files`` with POSIX_FADV_DONTNEED; needs no privilege."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_caches() -> str:
    """Best effort ``sync; echo 3 > /proc/sys/vm/drop_caches``; returns what happened, in words."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")
    except OSError as e:
        return f"not dropped ({e.strerror})"
    return "dropped"


def write_all(fd: int, view: memoryview, offset: int = 0) -> None:
    """pwrite ``view`` at ``offset`` completely (retrying short writes)."""
    done = 0
    while done < len(view):
        n = os.pwritev(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


def read_all(fd: int, view: memoryview, offset: int = 0) -> None:
    """pread exactly ``len(view)`` bytes at ``offset``; a short file is an error."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"unexpected end of file after {offset + done} bytes")
        done += n

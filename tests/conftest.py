"""Shared fixtures: small KV caches and stores on temporary directories."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tutti_cluster import TuttiConfig, TuttiStore

# A small model shape: 4 layers, 16-token blocks, 2 heads of 32 (uint16 stands in for bf16).
LAYERS, BLOCKS, BLOCK_TOKENS, HEADS, HEAD = 4, 96, 16, 2, 32
UNIT_TOKENS = 64  # 4 blocks per unit
LAYOUTS = ["kv_first", "block_first", "kv_tuple", "interleaved", "mla"]


def make_kv(layout: str = "kv_first", layers: int = LAYERS, blocks: int = BLOCKS, seed: int = 0,
            head: int = HEAD, page_offset: int | None = None) -> list:
    """Random KV of `layers` layers in `layout`. `page_offset`: each array in an anonymous mapping of
    its own, that many bytes past a page boundary (None: numpy's own allocation)."""
    rng = np.random.default_rng(seed)
    shapes = {
        "kv_first": (2, blocks, BLOCK_TOKENS, HEADS, head),
        "block_first": (blocks, 2, BLOCK_TOKENS, HEADS, head),
        "interleaved": (blocks, BLOCK_TOKENS, HEADS, 2 * head),
        "mla": (blocks, BLOCK_TOKENS, 2 * head),
    }

    def array(shape: tuple) -> np.ndarray:
        a = rng.integers(0, 65535, shape, dtype=np.uint16)
        if page_offset is None:
            return a
        placed = np.frombuffer(mmap.mmap(-1, a.nbytes + page_offset), dtype=np.uint16, count=a.size,
                               offset=page_offset).reshape(shape)
        placed[...] = a
        return placed

    if layout == "kv_tuple":
        return [tuple(array((blocks, BLOCK_TOKENS, HEADS, head)) for _ in range(2)) for _ in range(layers)]
    return [array(shapes[layout]) for _ in range(layers)]


def objects(kv_layer, layout: str) -> list:
    """The per-block objects of one layer: [kv][block] -> array."""
    if layout == "kv_first":
        return [kv_layer[0], kv_layer[1]]
    if layout == "block_first":
        return [kv_layer[:, 0], kv_layer[:, 1]]
    if layout == "kv_tuple":
        return list(kv_layer)
    return [kv_layer]


def zero(kv: list) -> None:
    for layer in kv:
        for t in layer if isinstance(layer, tuple) else (layer,):
            t[...] = 0


def refill(kv: list, rng) -> None:
    """Fills the KV blocks with other bytes, in place (a store keeps pointers to them)."""
    for layer in kv:
        for t in layer if isinstance(layer, tuple) else (layer,):
            t[...] = rng.integers(0, 65535, t.shape, dtype=np.uint16)


def snapshot(kv: list) -> list:
    return [tuple(t.copy() for t in l) if isinstance(l, tuple) else l.copy() for l in kv]


def assert_units_equal(src: list, src_blocks, dst: list, dst_blocks, layout: str, units: list[int], unit_blocks: int) -> None:
    for l in range(len(src)):
        a, b = objects(src[l], layout), objects(dst[l], layout)
        for o in range(len(a)):
            for u in units:
                for j in range(unit_blocks):
                    i = u * unit_blocks + j
                    np.testing.assert_array_equal(a[o][src_blocks[i]], b[o][dst_blocks[i]],
                                                  err_msg=f"layer {l} obj {o} unit {u} block {j}")


@pytest.fixture
def store_dirs(tmp_path: Path) -> list[Path]:
    dirs = [tmp_path / f"ssd{i}" for i in range(2)]
    for d in dirs:
        d.mkdir()
    return dirs


def open_store(dirs: list[Path], kv: list, layout: str = "kv_first", **kw) -> TuttiStore:
    cfg = dict(paths=dirs, capacity_gb=0.02, unit_tokens=UNIT_TOKENS, staging_mb=2, min_io_bytes=4096)
    cfg.update(kw)
    s = TuttiStore(TuttiConfig(**cfg))
    s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS, layout=layout)
    return s


def shm_dir(prefix: str = "tutti-test-") -> Path:
    """A fresh directory on /dev/shm (tmpfs: a memory tier's kind of file system); the test is
    skipped where the host has none. The caller removes it."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (tmpfs) on this host")
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))


@pytest.fixture
def mem_dir() -> Iterator[Path]:
    """A memory tier's directory on /dev/shm, removed afterwards."""
    d = shm_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[callable]:
    """Mounts small tmpfs (or ramfs) file systems, root only, to cause full, read-only and
    O_DIRECT-refusing disks for real."""
    mounts: list[Path] = []

    def mount(size: str = "1m", ro: bool = False, fstype: str = "tmpfs") -> Path:
        d = tmp_path / f"mnt{len(mounts)}"
        d.mkdir()
        opts = (f"size={size}" if fstype == "tmpfs" else "mode=755") + (",ro" if ro else "")
        r = subprocess.run(["mount", "-t", fstype, "-o", opts, fstype, str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root with mount rights")
        mounts.append(d)
        return d

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture
def hugetlbfs(tmp_path: Path) -> Iterator[Path]:
    """A hugetlbfs mount (root only) with 64 huge pages reserved for it: the host's reservation is
    raised for the test where it is lower, and put back afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting hugetlbfs and reserving huge pages needs root")
    knob = Path("/proc/sys/vm/nr_hugepages")
    try:
        before = int(knob.read_text())
        knob.write_text(str(before + 64))
    except OSError as e:
        pytest.skip(f"cannot reserve huge pages here ({e})")
    d = tmp_path / "huge"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "hugetlbfs", "-o", "mode=700", "hugetlbfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0 or int(knob.read_text()) < before + 64:
        knob.write_text(str(before))
        pytest.skip(f"no hugetlbfs with 64 free huge pages here ({r.stderr.strip() or 'too few pages'})")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)
    knob.write_text(str(before))


def run_threads(*targets: Callable[[], object]) -> None:
    """Runs each target on a thread of its own, waits for all, and raises the first exception any
    of them raised (an assertion failing in a thread fails the test)."""
    errors: list[BaseException] = []

    def run(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]

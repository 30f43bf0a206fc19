"""`tutti up --demo`: a synthetic Llama-3-8B-shaped prefix through store and retrieve.

The demo's store is an instance of its own (``demo`` unless ``--instance`` says) on the configured
paths (``<data_dir>/store`` by default); its pool files are removed when it ends unless ``keep``.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from tutti_cluster.config import TuttiConfig
from tutti_cluster.keys import chain_keys
from tutti_cluster.store import TuttiStore, pool_files

log = logging.getLogger(__name__)

# Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 (2-byte words), 16-token blocks.
LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS = 32, 8, 128, 16

T = TypeVar("T")


def _layers(items: Iterable[T], desc: str) -> Iterable[T]:
    """``items`` with a progress bar per layer on stderr where tqdm is installed (the ``bench`` extra
    brings it), else as they are: the demo needs no optional package."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="layer", leave=False)


@dataclass
class DemoResult:
    prefix_tokens: int
    hit_rate: float
    store_gbps: float
    retrieve_gbps: float
    exact: bool
    direct_io: bool
    pool_files: list[Path] = field(default_factory=list)  # the instance's pool files, kept or removed
    pool_bytes: int = 0  # their size on storage before removal
    kept: bool = False


def _own_file(path: Path) -> os.stat_result | None:
    """``path``'s status when it is a regular file of this user (never followed where it is a
    link), else None."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() else None


def run_demo(config: TuttiConfig, prefix_tokens: int = 8192, seed: int = 0, keep: bool = True) -> DemoResult:
    """Stores a random prefix, drops the KV, looks it up again and retrieves it into other blocks.

    Unless ``keep``, the instance's pool files are removed afterwards (whatever the outcome) where
    the demo's store opened them: never a pool another store holds (the demo's open then fails), a
    file of another user or a link put at their names. So are the default storage directory and
    data directory if the demo made them and they are empty.
    """
    made = [d for d in (config.data_dir, config.storage_paths()[0]) if not config.paths and not d.exists()]
    opened: list[bool] = []
    try:
        result = _run(config, prefix_tokens, seed, opened)
    finally:
        files = [f for f in pool_files(config) if _own_file(f) is not None]
        size = sum(st.st_size for f in files if (st := _own_file(f)) is not None)
        if not keep and opened:
            for f in files:
                f.unlink(missing_ok=True)
            for d in reversed(made):
                try:
                    d.rmdir()
                except OSError:  # not empty (or gone): leave it
                    pass
            log.debug("removed the demo's pool: %s (%.2f GiB)", ", ".join(map(str, files)) or "none", size / (1 << 30))
    result.pool_files, result.pool_bytes, result.kept = files, size, keep
    return result


def _run(config: TuttiConfig, prefix_tokens: int, seed: int, opened: list[bool]) -> DemoResult:
    unit = config.unit_tokens
    prefix_tokens = max(unit, prefix_tokens // unit * unit)
    blocks = prefix_tokens // BLOCK_TOKENS
    num_blocks = 2 * blocks  # room to land the retrieve in different blocks
    rng = np.random.default_rng(seed)
    # uint16 words stand in for bf16: the store moves bytes and never interprets them.
    kv = [np.empty((2, num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_SIZE), dtype=np.uint16) for _ in range(LAYERS)]
    for buf in _layers(kv, "make KV"):
        buf[...] = np.frombuffer(rng.bytes(buf.nbytes), dtype=np.uint16).reshape(buf.shape)
    tokens = rng.integers(0, 128_000, prefix_tokens).tolist()
    keys = chain_keys(tokens, unit, namespace=b"tutti-demo")
    kv_bytes = blocks * LAYERS * 2 * BLOCK_TOKENS * KV_HEADS * HEAD_SIZE * 2

    paths = ", ".join(map(str, config.storage_paths()))
    gib = sum(config.capacity_bytes()) / (1 << 30)
    fresh = not pool_files(config)
    if fresh:
        log.info("making the demo's pool at %s: %.2f GiB (instance %r)%s", paths, gib, config.instance,
                 "; a new pool is written once, which takes a moment" if config.prewrite_pool else "")
    else:
        log.info("opening the demo's pool at %s: %.2f GiB (instance %r)", paths, gib, config.instance)
    with TuttiStore(config) as store:
        store.register_kv_caches(kv, block_tokens=BLOCK_TOKENS, layout="kv_first")
        opened.append(True)  # its pool files are this store's: the clean-up may remove them
        log.info("storing %d tokens of KV (%.2f GiB, %d layers) and reading them back into other blocks",
                 prefix_tokens, kv_bytes / (1 << 30), LAYERS)
        for k in store.keys():  # a fresh start each time the demo runs
            store.remove(k)
        src = rng.permutation(num_blocks)[:blocks]
        t0 = time.perf_counter()
        req = store.begin_store(keys, src)
        for layer in _layers(range(LAYERS), "store"):
            store.store_layer(layer, req)
        res = store.finish(req)
        t_store = time.perf_counter() - t0
        if not res.ok:
            log.warning("demo: %d units failed to store", len(res.failed_units))
        want = [l[:, src].copy() for l in kv]
        for buf in kv:
            buf[...] = 0
        hit = store.lookup(keys)
        dst = rng.permutation(num_blocks)[: hit * store.unit_blocks]
        t0 = time.perf_counter()
        req = store.begin_retrieve(keys[:hit], dst)
        for layer in _layers(range(LAYERS), "retrieve"):
            store.retrieve_layer(layer, req)
        for layer in range(LAYERS):
            store.wait_layer(layer, req)
        rres = store.finish(req)
        t_retrieve = time.perf_counter() - t0
        n = hit * store.unit_blocks
        exact = rres.ok and all(np.array_equal(w[:, :n], l[:, dst]) for w, l in zip(want, kv))
        direct = bool(store.stats()["direct_io"])
    hit_bytes = kv_bytes * hit / len(keys)
    return DemoResult(prefix_tokens, hit / len(keys), kv_bytes / t_store / 1e9, hit_bytes / t_retrieve / 1e9, exact,
                      direct)

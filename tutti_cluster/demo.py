"""`tutti up --demo`: a synthetic Llama-3-8B-shaped prefix through store and retrieve."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from tutti_cluster.config import TuttiConfig
from tutti_cluster.keys import chain_keys
from tutti_cluster.store import TuttiStore

log = logging.getLogger(__name__)

# Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 (2-byte words), 16-token blocks.
LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS = 32, 8, 128, 16


@dataclass
class DemoResult:
    prefix_tokens: int
    hit_rate: float
    store_gbps: float
    retrieve_gbps: float
    exact: bool
    direct_io: bool


def run_demo(config: TuttiConfig, prefix_tokens: int = 8192, seed: int = 0) -> DemoResult:
    """Stores a random prefix, drops the KV, looks it up again and retrieves it into other blocks."""
    unit = config.unit_tokens
    prefix_tokens = max(unit, prefix_tokens // unit * unit)
    blocks = prefix_tokens // BLOCK_TOKENS
    num_blocks = 2 * blocks  # room to land the retrieve in different blocks
    rng = np.random.default_rng(seed)
    # uint16 words stand in for bf16: the store moves bytes and never interprets them.
    kv = [np.empty((2, num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_SIZE), dtype=np.uint16) for _ in range(LAYERS)]
    for layer in tqdm(kv, desc="make KV", unit="layer", leave=False):
        layer[...] = np.frombuffer(rng.bytes(layer.nbytes), dtype=np.uint16).reshape(layer.shape)
    tokens = rng.integers(0, 128_000, prefix_tokens).tolist()
    keys = chain_keys(tokens, unit, namespace=b"tutti-demo")
    kv_bytes = blocks * LAYERS * 2 * BLOCK_TOKENS * KV_HEADS * HEAD_SIZE * 2

    with TuttiStore(config) as store:
        store.register_kv_caches(kv, block_tokens=BLOCK_TOKENS, layout="kv_first")
        for k in store.keys():  # a fresh start each time the demo runs
            store.remove(k)
        src = rng.permutation(num_blocks)[:blocks]
        t0 = time.perf_counter()
        req = store.begin_store(keys, src)
        for layer in tqdm(range(LAYERS), desc="store", unit="layer", leave=False):
            store.store_layer(layer, req)
        res = store.finish(req)
        t_store = time.perf_counter() - t0
        if not res.ok:
            log.warning("demo: %d units failed to store", len(res.failed_units))
        want = [l[:, src].copy() for l in kv]
        for layer in kv:
            layer[...] = 0
        hit = store.lookup(keys)
        dst = rng.permutation(num_blocks)[: hit * store.unit_blocks]
        t0 = time.perf_counter()
        req = store.begin_retrieve(keys[:hit], dst)
        for layer in tqdm(range(LAYERS), desc="retrieve", unit="layer", leave=False):
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

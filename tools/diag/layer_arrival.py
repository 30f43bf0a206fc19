"""Diagnostic: when each layer of one retrieve lands (the CPU backend), the shape of the vLLM CPU
bench's restore: 8 layers of 32-token blocks (8 KV heads of 128, bf16), 33 units of 256 tokens.
A layer's compute can start once it has landed, so the first layer's time is what a restore adds to
time to first token before any compute hides it. Not part of the suite.

    python tools/diag/layer_arrival.py /dev/shm/la [--busy] [--drop-caches] [--queue-depth 64]

``--busy`` runs a 2048x2048 matmul loop on a thread beside (an engine's compute); under
``THP_MEM_ALLOC_ENABLE=1`` torch allocates the KV cache page-aligned and an O_DIRECT disk reads
straight into it (``direct_ios``).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np
import torch

from tutti_cluster import TuttiConfig, TuttiStore
from tutti_cluster.bench import fsutil

LAYERS, BLOCKS, BLOCK_TOKENS, HEADS, HEAD, UNITS = 8, 600, 32, 8, 128, 33


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--busy", action="store_true")
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--queue-depth", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    os.makedirs(a.path, exist_ok=True)
    kv = [torch.zeros((2, BLOCKS, BLOCK_TOKENS, HEADS, HEAD), dtype=torch.bfloat16) for _ in range(LAYERS)]
    for t in kv:
        t.view(torch.int16).random_()
    s = TuttiStore(TuttiConfig(paths=[a.path], unit_tokens=256, capacity_gb=1.0, pool_files=1,
                               queue_depth=a.queue_depth))
    s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS)
    n = UNITS * s.unit_blocks
    keys = list(range(1000, 1000 + UNITS))
    if s.lookup(keys) < UNITS:
        assert s.store(keys, np.arange(n)).ok
    stop = threading.Event()

    def burn() -> None:
        m = torch.randn(2048, 2048)
        while not stop.is_set():
            m @ m

    if a.busy:
        threading.Thread(target=burn, daemon=True).start()
        time.sleep(0.5)
    for _ in range(a.repeat):
        if a.drop_caches:
            fsutil.drop_caches()
        req = s.begin_retrieve(keys, np.arange(n, 2 * n))
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            s.retrieve_layer(layer, req)
        landed = []
        for layer in range(LAYERS):
            s.wait_layer(layer, req)
            landed.append((time.perf_counter() - t0) * 1e3)
        ok = s.finish(req).ok
        print(f"{'busy' if a.busy else 'idle'} {a.path}: layers landed at (ms) "
              + " ".join(f"{x:.1f}" for x in landed) + f"; ok {ok}; direct_ios {s.stats().get('direct_ios', '-')}")
    stop.set()
    s.close()


if __name__ == "__main__":
    main()

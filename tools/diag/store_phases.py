"""Where a store's (and then a retrieve's) time goes: begin, issue (32 layer calls), each layer's
wait, finish.

Drives a TuttiStore (the CUDA backend when a GPU is present, else the CPU one) through the same calls
as the bench's `tutti` system, Llama-3-8B shape, and prints milliseconds per phase for each round;
each round stores a prefix, then retrieves it into other blocks:

    python tools/diag/store_phases.py --paths /dev/shm/tb0 /dev/shm/tb1 --prefix-tokens 16K 64K
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from tutti_cluster import TuttiStore
from tutti_cluster.bench.kvdata import KVData, KVShape
from tutti_cluster.bench.tutti_system import pool_bytes_per_path
from tutti_cluster.config import load_config


def tokens(text: str) -> int:
    return int(text[:-1]) * 1024 if text.upper().endswith("K") else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", type=Path, nargs="+", required=True)
    p.add_argument("--prefix-tokens", type=tokens, nargs="+", default=[16384, 65536])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--mapped", action="store_true", help="map_memory_paths (off: through io_uring)")
    p.add_argument("--reopen", action="store_true",
                   help="after the rounds, close the store and run them again in a new store on the same pool files")
    a = p.parse_args()
    shape = KVShape()
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for d in a.paths:
        d.mkdir(parents=True, exist_ok=True)
    for n_tokens in a.prefix_tokens:
        n = n_tokens // shape.block_tokens
        kv = KVData(shape, n, dev, seed=1)
        cap = pool_bytes_per_path(n * shape.block_bytes, len(a.paths)) / (1 << 30)
        cfg = load_config(paths=a.paths, capacity_gb=[cap], instance=f"phases{n_tokens}",
                          backend=dev.type, map_memory_paths=a.mapped)
        rng = np.random.default_rng(0)
        for opened in range(1 + a.reopen):
            t_open = time.perf_counter()
            with TuttiStore(cfg) as s:
                s.register_kv_caches(kv.layers, block_tokens=shape.block_tokens)
                print(f"{n_tokens // 1024}K store {opened}: open and register {time.perf_counter() - t_open:.2f} s")
                for r in range(a.rounds):
                    keys = [int(k) for k in rng.integers(1, 2**62, n // s.unit_blocks)]
                    for op, begin, issue in (("store", s.begin_store, s.store_layer),
                                             ("retrieve", s.begin_retrieve, s.retrieve_layer)):
                        sync()
                        t0 = time.perf_counter()
                        h = begin(keys, rng.permutation(n).tolist())
                        t1 = time.perf_counter()
                        for layer in range(shape.layers):
                            issue(layer, h)
                        t2 = time.perf_counter()
                        waits = []
                        for layer in range(shape.layers):
                            # stream=0: the host waits for the layer's own completion (on CUDA a device
                            # synchronize would also wait for the later layers' kernels).
                            s.wait_layer(layer, h, stream=0)
                            waits.append(time.perf_counter())
                        res = s.finish(h)
                        t3 = time.perf_counter()
                        ms = [1e3 * (b - a_) for a_, b in zip([t2, *waits[:-1]], waits)]
                        print(f"{n_tokens // 1024}K store {opened} round {r} {op}: begin {1e3 * (t1 - t0):.1f} ms, "
                              f"issue {1e3 * (t2 - t1):.1f}, layer waits {' '.join(f'{x:.1f}' for x in ms)}, "
                              f"finish {1e3 * (t3 - waits[-1]):.1f}, total {1e3 * (t3 - t0):.1f} ms, "
                              f"{n * shape.block_bytes / (t3 - t0) / 1e9:.1f} GB/s, ok={res.ok}")
        for d in a.paths:
            for f in d.glob(f"tutti-phases{n_tokens}*.pool"):
                f.unlink()


if __name__ == "__main__":
    main()

"""GPU host diagnostic: how long one layer's retrieve (and a whole prefix's) takes alone, and while
matrix multiplies run on the store's compute stream (the SMs outside the I/O partition) or on a
stream of the whole device. Times are CUDA events on a side stream around ``retrieve_layer`` and
``wait_layer``; the compute is queued after the reads are issued, so both run at once.

    python3 tools/diag/io_beside_compute.py --paths /dev/shm/a /dev/shm/b --tokens 32K [--pool-tokens 128K] --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from tutti_cluster import TuttiStore
from tutti_cluster.bench.options import parse_tokens
from tutti_cluster.bench.prefill.model import PagedKV, model_shape
from tutti_cluster.bench.tutti_system import pool_bytes_per_path
from tutti_cluster.config import load_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paths", nargs="+", required=True)
    ap.add_argument("--tokens", default="32K")
    ap.add_argument("--pool-tokens", default=None, help="size the pool for this many tokens (default: --tokens)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    shape = model_shape("llama3-8b", None)
    tokens = parse_tokens(a.tokens)
    dev = torch.device("cuda")
    kv = PagedKV(shape, tokens // shape.block_tokens, dev)
    pool = max(tokens, parse_tokens(a.pool_tokens)) if a.pool_tokens else tokens
    cap = pool_bytes_per_path(pool * shape.kv_bytes_per_token, len(a.paths)) / (1 << 30)
    store = TuttiStore(load_config(paths=a.paths, capacity_gb=[cap] * len(a.paths), backend="cuda", instance="diag"))
    store.register_kv_caches(kv.layers, block_tokens=shape.block_tokens, layout="kv_first")
    unit = store.unit_tokens
    keys = list(range(1, tokens // unit + 1))
    ids = list(range(tokens // shape.block_tokens))
    kv.all.normal_()
    res = store.store(keys, ids)
    assert not res.failed_units
    compute = torch.cuda.ExternalStream(store.compute_stream()) if store.compute_stream() else None
    whole = torch.cuda.Stream()
    side = torch.cuda.Stream()
    x = torch.randn(8192, 4096, dtype=torch.bfloat16, device=dev)
    w = torch.randn(4096, 14336, dtype=torch.bfloat16, device=dev)

    def timed(layers: int, stream: torch.cuda.Stream, busy: torch.cuda.Stream | None = None, between: int = 0) -> float:
        """The reads issued, then ``between`` multiplies, then the waits, all on ``stream``; 60
        multiplies (about 0.1 s) on ``busy`` beside them."""
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        req = store.begin_retrieve(keys, ids)
        with torch.cuda.stream(stream):
            t0.record()
            for l in range(layers):
                store.retrieve_layer(l, req)
            for _ in range(between):
                x @ w
        if busy is not None:
            with torch.cuda.stream(busy):
                for _ in range(60):
                    x @ w
        with torch.cuda.stream(stream):
            for l in range(layers):
                store.wait_layer(l, req)
            t1.record()
        torch.cuda.synchronize()
        r = store.finish(req)
        # Layers never issued leave their units unvouched for: only a whole-prefix read can pass.
        assert layers < shape.layers or not r.failed_units
        return t0.elapsed_time(t1)

    out: dict[str, dict[str, float]] = {}

    def measure(name: str, layers: int, stream: torch.cuda.Stream, busy: torch.cuda.Stream | None = None,
                between: int = 0) -> None:
        timed(layers, stream, busy, between)  # warm
        ms = [timed(layers, stream, busy, between) for _ in range(a.rounds)]
        gb = layers * tokens * shape.kv_bytes_per_token / shape.layers / 1e9
        med = statistics.median(ms)
        out[name] = {"ms": round(med, 3), "runs_ms": [round(m, 3) for m in ms], "gbps": round(gb / med * 1e3, 2)}
        print(f"{name:<60} {med:8.3f} ms  {gb / med * 1e3:6.2f} GB/s  {[round(m, 1) for m in ms]}")

    # As the pipeline issues them: ordered and waited on the compute stream, its work in between.
    for gemms in (0, 3):
        measure(f"1 layer on the compute stream, {gemms} multiplies between", 1, compute or whole, between=gemms)
    for layers in (1, shape.layers):
        for name, busy in (("alone", None), ("beside compute stream", compute), ("beside whole device", whole)):
            if name == "beside compute stream" and compute is None:
                continue
            measure(f"{layers} layer(s) {name}", layers, side, busy)
    # The compute alone, for scale.
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(compute or whole):
        e0.record()
        for _ in range(60):
            x @ w
        e1.record()
    torch.cuda.synchronize()
    print(f"60 GEMMs alone {e0.elapsed_time(e1):.1f} ms")
    store.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

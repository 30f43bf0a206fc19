"""Where a hot set's retrieve from mapped memory files loses time against the host-to-GPU limit
(CUDA only).

Stores one prefix (Llama-3-8B shape) into mapped pool files on ``--paths`` (the ``tutti-mapped``
system of ``tutti bench``), then retrieves it ``--rounds`` times. Each layer's arrival is taken on
the GPU: an event on a side stream before ``begin_retrieve``, and after each ``wait_layer`` (that
stream waits for the layer's I/O) another, so the host's own waiting adds nothing; every retrieve
must finish with every checksum matching. Beside it, in the same run: the bench's host-to-GPU
limit (1 GiB copies from pinned memory) and the same bytes as one copy per layer, timed the same
way. Each ``--variant`` (config fields, comma separated) opens a
store of its own:

    python tools/diag/hot_set_timeline.py --paths /dev/shm/ht0 /dev/shm/ht1 /dev/shm/ht2 /dev/shm/ht3 \\
        --prefix-tokens 16K 128K --variant copy_engine_mb=1024 --variant copy_engine_mb=0 --json t.json --plot t.png
    python tools/diag/hot_set_timeline.py --replot t.json --plot t.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from tutti_cluster import TuttiStore
from tutti_cluster.bench import fsutil
from tutti_cluster.bench.kvdata import KVData, KVShape
from tutti_cluster.bench.limits import measure_h2d
from tutti_cluster.bench.tutti_system import pool_bytes_per_path
from tutti_cluster.config import load_config


def tokens(text: str) -> int:
    return int(text[:-1]) * 1024 if text.upper().endswith("K") else int(text)


def variant(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def layer_copies(layer_bytes: int, layers: int, rounds: int) -> dict:
    """One host-to-GPU copy per layer from pinned memory (a 1 GiB buffer, reused), each layer's end
    as an event: what the copy engine alone gives the retrieve's shape."""
    src = torch.empty(min(layer_bytes, 1 << 30), dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(layer_bytes, dtype=torch.uint8, device="cuda")
    totals, steps = [], []
    for _ in range(rounds):
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(layers + 1)]
        torch.cuda.synchronize()
        evs[0].record()
        for layer in range(layers):
            for off in range(0, layer_bytes, src.numel()):
                n = min(src.numel(), layer_bytes - off)
                dst[off:off + n].copy_(src[:n], non_blocking=True)
            evs[layer + 1].record()
        torch.cuda.synchronize()
        t = [evs[0].elapsed_time(e) for e in evs[1:]]
        totals.append(t[-1])
        steps.append(statistics.median(b - a for a, b in zip(t, t[1:])))
    del src, dst
    return {"total_ms": totals, "step_ms": steps}


def retrieve_rounds(s: TuttiStore, keys: list[int], ids: list[int], layers: int, rounds: int) -> list[dict]:
    side = torch.cuda.Stream()
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(layers + 1)]
        with torch.cuda.stream(side):
            t0 = time.perf_counter()
            evs[0].record()
            h = s.begin_retrieve(keys, ids)
            t1 = time.perf_counter()
            for layer in range(layers):
                s.retrieve_layer(layer, h)
            t2 = time.perf_counter()
            for layer in range(layers):
                s.wait_layer(layer, h)
                evs[layer + 1].record()
            t3 = time.perf_counter()
            res = s.finish(h)
            t4 = time.perf_counter()
        torch.cuda.synchronize()
        t5 = time.perf_counter()
        assert res.ok and not res.failed_units, res
        arr = [evs[0].elapsed_time(e) for e in evs[1:]]
        steps = [b - a for a, b in zip(arr, arr[1:])]
        out.append({"begin_ms": 1e3 * (t1 - t0), "issue_ms": 1e3 * (t2 - t1), "waits_queued_ms": 1e3 * (t3 - t2),
                    "finish_ms": 1e3 * (t4 - t3), "sync_ms": 1e3 * (t5 - t4), "host_total_ms": 1e3 * (t5 - t0),
                    "first_layer_ms": arr[0], "last_layer_ms": arr[-1], "step_p50_ms": statistics.median(steps),
                    "step_max_ms": max(steps), "steps_ms": [round(x, 3) for x in steps]})
    return out


def plot(report: dict, path: Path) -> None:
    """Each layer's arrival (the median round of each variant) against one plain copy per layer,
    a panel per prefix."""
    from tutti_cluster.bench.plot import save_figure, subplots

    prefixes = sorted({c["prefix_tokens"] for c in report["cells"]})
    fig, axes = subplots(1, len(prefixes), (5.5 * len(prefixes), 4.2))
    for ax, n_tokens in zip(axes[0], prefixes):
        for c in (c for c in report["cells"] if c["prefix_tokens"] == n_tokens):
            if c["system"] == "copy per layer":
                step = statistics.median(c["step_ms"])
                layers = report["layers"]
                ax.plot(range(1, layers + 1), [step * (i + 1) for i in range(layers)], "k--",
                        label="one plain copy per layer")
                continue
            r = sorted(c["rounds"], key=lambda x: x["last_layer_ms"])[len(c["rounds"]) // 2]
            arrivals = [r["first_layer_ms"]]
            for d in r["steps_ms"]:
                arrivals.append(arrivals[-1] + d)
            label = ", ".join(f"{k} {v}" for k, v in c["fields"].items()) or "defaults"
            ax.plot(range(1, len(arrivals) + 1), arrivals, marker=".", label=label)
        ax.set_title(f"{n_tokens // 1024}K-token prefix")
        ax.set_xlabel("layer")
        ax.set_ylabel("lands after (ms, GPU events)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    title = f"a hot set in memory, layer by layer ({report['gpu']}, host-to-GPU {report['h2d_gbps']} GB/s)"
    save_figure(fig, path, title)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replot", type=Path, metavar="JSON", help="draw --plot from an earlier --json report, and stop")
    p.add_argument("--plot", type=Path, metavar="PNG")
    p.add_argument("--paths", type=Path, nargs="+")
    p.add_argument("--prefix-tokens", type=tokens, nargs="+", default=[16384, 131072])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variant", type=variant, action="append", default=None,
                   help="config fields of one store, e.g. copy_engine_mb=1024,io_sms=8 (repeatable)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.replot:
        if not a.plot:
            p.error("--replot needs --plot")
        plot(json.loads(a.replot.read_text()), a.plot)
        return
    if not a.paths:
        p.error("--paths is required")
    shape = KVShape()
    cap = pool_bytes_per_path(sum(shape.prefix_bytes(t) for t in a.prefix_tokens), len(a.paths)) / (1 << 30)
    # Every variant's config first: a bad one fails before anything is measured.
    cfgs = [(fields, load_config(paths=a.paths, capacity_gb=[cap], instance="timeline", backend="cuda",
                                 map_memory_paths=True, **{"staging_mb": 2048, "queue_depth": 64, **fields}))
            for fields in a.variant or [{}]]
    largest = max(a.prefix_tokens) // shape.block_tokens
    kv = KVData(shape, largest, torch.device("cuda:0"), seed=1)
    buf = fsutil.aligned_buffer(1 << 30)
    buf.write(b"\x01" * len(buf))
    with contextlib.closing(fsutil.PinnedRegion(buf)):
        h2d = measure_h2d(buf, torch.device("cuda:0"))
    report = {"gpu": torch.cuda.get_device_name(0), "h2d_gbps": round(h2d, 2), "layers": shape.layers, "cells": []}
    print(f"host-to-GPU limit {h2d:.1f} GB/s ({report['gpu']})", flush=True)
    for n_tokens in a.prefix_tokens:
        lc = layer_copies(shape.prefix_bytes(n_tokens) // shape.layers, shape.layers, a.rounds)
        report["cells"].append({"prefix_tokens": n_tokens, "system": "copy per layer", **lc})
        print(f"{n_tokens // 1024}K one copy per layer: total {min(lc['total_ms']):.2f}-{max(lc['total_ms']):.2f} ms, "
              f"step p50 {statistics.median(lc['step_ms']):.3f} ms "
              f"({shape.prefix_bytes(n_tokens) / min(lc['total_ms']) / 1e6:.1f} GB/s)", flush=True)
    for fields, cfg in cfgs:
        for d in a.paths:
            d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        try:
            with TuttiStore(cfg) as s:
                s.register_kv_caches(kv.layers, block_tokens=shape.block_tokens)
                for n_tokens in a.prefix_tokens:
                    n = n_tokens // shape.block_tokens
                    keys = [int(k) for k in rng.integers(1, 2**62, n // s.unit_blocks)]
                    assert s.store(keys, rng.permutation(n).tolist()).ok
                    torch.cuda.synchronize()
                    rows = retrieve_rounds(s, keys, rng.permutation(n).tolist(), shape.layers, a.rounds)
                    nbytes = shape.prefix_bytes(n_tokens)
                    report["cells"].append({"prefix_tokens": n_tokens, "system": "tutti-mapped", "fields": fields,
                                            "rounds": rows})
                    for r in rows:
                        print(f"{fields} {n_tokens // 1024}K: host {r['host_total_ms']:.2f} ms "
                              f"({nbytes / r['host_total_ms'] / 1e6 / h2d:.3f}x limit), GPU first layer "
                              f"{r['first_layer_ms']:.2f}, last {r['last_layer_ms']:.2f} "
                              f"({nbytes / r['last_layer_ms'] / 1e6 / h2d:.3f}x), step p50 {r['step_p50_ms']:.3f} "
                              f"max {r['step_max_ms']:.3f}; begin {r['begin_ms']:.2f} issue {r['issue_ms']:.2f} "
                              f"waits {r['waits_queued_ms']:.2f} finish {r['finish_ms']:.2f} sync {r['sync_ms']:.2f}",
                              flush=True)
        finally:
            for d in a.paths:
                shutil.rmtree(d, ignore_errors=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    if a.plot:
        plot(report, a.plot)


if __name__ == "__main__":
    main()

"""GPU host diagnostic: kernel by kernel, where a restoring prefill's first layer loses time against
the resident (ideal) one. Runs the pipeline harness at one (input, prefix) on /dev/shm, then one
ideal and one tutti prefill under ``torch.profiler`` and prints, for the first layers of each, every
kernel on the compute stream with its duration and the gap before it (the GPU idle, waiting for
the host or for an event), plus the I/O kernels beside them. A Chrome trace of each run goes to
``--out``.

    python3 tools/diag/pipeline_trace.py --paths /dev/shm/a /dev/shm/b --input 64K --prefix 32K --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from tutti_cluster import TuttiStore
from tutti_cluster.bench.options import parse_tokens
from tutti_cluster.bench.prefill import harness as hz
from tutti_cluster.bench.prefill.model import Decoder, PagedKV, model_shape
from tutti_cluster.bench.tutti_system import pool_bytes_per_path
from tutti_cluster.config import load_config
from tutti_cluster.pipeline.hooks import LayerHooks


class _Marks(LayerHooks):
    """A named range per layer (``layer N``) so that the trace shows where each layer starts."""

    def __init__(self) -> None:
        self.ctx: Any = None

    def before_layer(self, layer: int) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(None, None, None)
        self.ctx = torch.profiler.record_function(f"layer {layer}")
        self.ctx.__enter__()

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(None, None, None)
            self.ctx = None


def kernels(trace: Path) -> list[dict[str, Any]]:
    ev = json.loads(trace.read_text())["traceEvents"]
    return sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def layer0_start(trace: Path) -> float | None:
    """Where the GPU reached the first layer (its ``layer 0`` range on the GPU timeline)."""
    ev = json.loads(trace.read_text())["traceEvents"]
    ts = [e["ts"] for e in ev if e.get("name") == "layer 0" and e.get("cat") == "gpu_user_annotation"]
    return min(ts) if ts else None


def summary(name: str, ks: list[dict[str, Any]], first_ms: float, start: float | None) -> dict[str, Any]:
    """Kernels in the first ``first_ms`` from ``start`` (default: the first kernel), by stream: busy
    time, idle gaps, top kernels."""
    if start is not None:
        ks = [k for k in ks if k["ts"] + k["dur"] >= start]
    if not ks:
        return {}
    t0 = ks[0]["ts"] if start is None else start
    by_stream: dict[int, list[dict[str, Any]]] = {}
    for k in ks:
        if k["ts"] - t0 <= first_ms * 1e3:
            by_stream.setdefault(k["args"].get("stream", k.get("tid")), []).append(k)
    out: dict[str, Any] = {}
    for s, lst in by_stream.items():
        busy = sum(k["dur"] for k in lst)
        gaps = [(b["ts"] - (a["ts"] + a["dur"]), b["name"][:60]) for a, b in zip(lst, lst[1:])]
        big = sorted(gaps, reverse=True)[:5]
        top = sorted(((k["dur"], k["name"][:70], round((k["ts"] - t0) / 1e3, 2)) for k in lst), reverse=True)[:8]
        out[str(s)] = {"kernels": len(lst), "busy_ms": round(busy / 1e3, 3),
                       "span_ms": round((lst[-1]["ts"] + lst[-1]["dur"] - lst[0]["ts"]) / 1e3, 3),
                       "largest_gaps_ms": [(round(g / 1e3, 3), n) for g, n in big],
                       "longest_kernels_ms": [(round(d / 1e3, 3), n, at) for d, n, at in top]}
    print(f"--- {name}: first {first_ms} ms")
    for s, v in out.items():
        print(f" stream {s}: {v['kernels']} kernels, busy {v['busy_ms']} ms of {v['span_ms']} ms")
        for g in v["largest_gaps_ms"]:
            print(f"   gap {g[0]:8.3f} ms before {g[1]}")
        for d in v["longest_kernels_ms"]:
            print(f"   kernel {d[0]:8.3f} ms at {d[2]:8.2f} ms  {d[1]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paths", nargs="+", required=True)
    ap.add_argument("--input", default="64K")
    ap.add_argument("--prefix", default="32K")
    ap.add_argument("--first-ms", type=float, default=250.0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    shape = model_shape(a.model, None)
    n, p = parse_tokens(a.input), parse_tokens(a.prefix)
    dev = torch.device(a.device)
    kv = PagedKV(shape, n // shape.block_tokens + 1, dev)
    cap = pool_bytes_per_path(p * shape.kv_bytes_per_token, len(a.paths)) / (1 << 30)
    store = TuttiStore(load_config(paths=a.paths, capacity_gb=[cap] * len(a.paths), backend=dev.type,
                                   instance="trace", staging_mb=2048))
    store.register_kv_caches(kv.layers, block_tokens=shape.block_tokens, layout="kv_first")
    model = Decoder(shape, dev)
    h = hz.Harness(model, kv, store)
    case = h.new_case(n, p)
    h.prepare(case, compute=False)
    h.warm_up(case, p)
    result: dict[str, Any] = {}
    for system in ("ideal", "tutti", "ideal", "tutti"):  # the first pair warms up
        h.run(system, case, p)
    for system in ("ideal", "tutti"):
        marks = _Marks()
        orig = h._prefill

        def traced(c: Any, pre: int, hooks: Any = None) -> Any:
            return orig(c, pre, hz._Chain(marks, hooks) if hooks is not None else marks)

        h._prefill = traced  # type: ignore[method-assign]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            o = h.run(system, case, p)
        marks.close()
        h._prefill = orig  # type: ignore[method-assign]
        trace = a.out / f"{system}.json"
        prof.export_chrome_trace(str(trace))
        print(f"{system}: TTFT {o.ttft_s:.4f} s, layer 0 {o.extra.get('layer_ms', [None])[0]} ms")
        result[system] = {"ttft_s": o.ttft_s, "layer_ms": o.extra.get("layer_ms", [])[:4],
                          "streams": summary(system, kernels(trace), a.first_ms, layer0_start(trace))}
    store.close()
    (a.out / "summary.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

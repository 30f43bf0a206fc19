"""``tutti profile``: the offline profiler of the slack-aware scheduler.

For a model shape and an SM split (the compute partition beside the store's ``io_sms`` I/O
partition), it times each layer of a prefill with a resident prefix on a grid of (input length,
prefix length) points aligned to 32 tokens, and saves the idle windows in a lookup table: per grid
point and layer, the window's duration (the layer's compute time, during which the I/O partition
is free) and the free SM budget (the I/O partition's SMs). The file is keyed by the model shape,
the GPU and the SM split; :class:`SlackTable` refuses a file made for another key and interpolates
between grid points (linearly in the prefix, then in the input).

Torch is imported only when a profile runs or loads, so ``tutti profile --help`` needs none.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tutti_cluster.errors import ConfigError

log = logging.getLogger(__name__)

ALIGN = 32  # tokens: the grid's step (one warp's worth of tokens, as the paper's table)
FORMAT = 1
PROFILE_CONFIG_FIELDS = ("paths", "data_dir", "io_sms", "unit_tokens")


def profile_key(model_key: str, gpu: str, io_sms: int) -> dict[str, Any]:
    return {"model": model_key, "gpu": gpu, "io_sms": io_sms}


def device_name(device: Any) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class SlackTable:
    """A profile file's windows: ``windows(n, p)`` -> per-layer seconds for input ``n``, prefix ``p``."""

    def __init__(self, data: dict[str, Any]) -> None:
        if data.get("format") != FORMAT:
            raise ConfigError(f"profile format {data.get('format')!r}; this version reads format {FORMAT}")
        self.key = data["key"]
        self.layers = int(data["layers"])
        self.sms = data.get("sms")
        by: dict[int, list[tuple[int, list[float]]]] = {}
        for g in data["grid"]:
            if len(g["layer_ms"]) != self.layers:
                raise ConfigError(f"profile point {g['input']}/{g['prefix']}: {len(g['layer_ms'])} layers, "
                                  f"expected {self.layers}")
            by.setdefault(int(g["input"]), []).append((int(g["prefix"]), [x / 1e3 for x in g["layer_ms"]]))
        if not by:
            raise ConfigError("the profile has no grid points")
        self._by = {n: sorted(pts) for n, pts in sorted(by.items())}

    @classmethod
    def load(cls, path: Path, shape: Any, device: Any, io_sms: int) -> "SlackTable":
        """Reads ``path`` and checks that it was made for this model shape, GPU and SM split."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the profile {path}: {e}") from None
        t = cls(data)
        want = profile_key(shape.key(), device_name(device), io_sms if device.type == "cuda" else 0)
        if t.key != want:
            raise ConfigError(f"profile {path} was made for {t.key}, this run is {want}: run `tutti profile` here")
        return t

    @staticmethod
    def _lerp(pts: Sequence[tuple[int, list[float]]], x: float) -> list[float]:
        if x <= pts[0][0]:
            return list(pts[0][1])
        if x >= pts[-1][0]:
            return list(pts[-1][1])
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x0 <= x <= x1:
                f = (x - x0) / (x1 - x0) if x1 > x0 else 0.0
                return [a + (b - a) * f for a, b in zip(y0, y1)]
        return list(pts[-1][1])

    def windows(self, n: int, prefix: int) -> list[float]:
        """Per-layer windows (seconds), the query rounded to the 32-token grid, then interpolated."""
        n, prefix = round(n / ALIGN) * ALIGN, round(prefix / ALIGN) * ALIGN
        inputs = list(self._by)
        rows = [(m, self._lerp(self._by[m], prefix * m / n if n else 0)) for m in inputs]
        if len(rows) == 1:
            return rows[0][1]
        # Across inputs the prefix is taken at the same hit rate, then interpolated in the input.
        return self._lerp(rows, n)


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    from tutti_cluster.config import add_config_arguments

    p = parser_class(prog="tutti profile", description="Offline profile of a model shape's per-layer compute on a "
                     "(input, prefix) grid aligned to 32 tokens, with the store's I/O partition of io_sms SMs set "
                     "aside (CUDA): the slack windows `tutti bench --pipeline --profile` schedules I/O into. "
                     "Needs PyTorch.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks on errors")
    p.add_argument("--model", choices=("llama3-8b", "glm4-9b-1m", "tiny"),
                   help="model shape [default: tiny on --device cpu, else llama3-8b]")
    p.add_argument("--model-layers", type=int, metavar="N", help="override the shape's layer count")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto", help="where the model runs")
    p.add_argument("--inputs", nargs="+", metavar="N", help="input lengths [default: 64K,128K; CPU 1K,2K]")
    p.add_argument("--prefix-tokens", nargs="+", metavar="P",
                   help="prefix lengths: tokens, shares (75%%) or -1u [default: 0%%,25%%,50%%,75%%,-1u]")
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="runs per point (the median is kept)")
    p.add_argument("--attention", choices=("auto", "flex", "sdpa", "split"), default="auto")
    p.add_argument("--out", type=Path, metavar="PATH",
                   help="profile file [default: <data_dir>/profiles/<model>-<gpu>-<io_sms>sm.json]")
    p.add_argument("--seed", type=int, default=0)
    add_config_arguments(p, PROFILE_CONFIG_FIELDS)
    return p


def _grid(args: argparse.Namespace, unit: int, cpu: bool) -> list[tuple[int, int]]:
    from tutti_cluster.bench.pipeline import CPU_INPUTS, DEFAULT_INPUTS, prefix_for
    from tutti_cluster.bench.runner import _split, parse_tokens

    inputs = sorted({parse_tokens(t) for t in _split(args.inputs) or (CPU_INPUTS if cpu else DEFAULT_INPUTS)})
    specs = _split(args.prefix_tokens) or ["0%", "25%", "50%", "75%", "-1u"]
    grid = []
    for n in inputs:
        if n <= 0 or n % ALIGN:
            raise ConfigError(f"input of {n} tokens: the grid is aligned to {ALIGN} tokens")
        for spec in specs:
            p = 0 if spec.strip() in ("0", "0%") else prefix_for(spec, n, max(ALIGN, unit if spec == "-1u" else ALIGN))
            p = p // ALIGN * ALIGN
            if not 0 <= p < n:
                continue
            grid.append((n, p))
    if not grid:
        raise ConfigError("the grid is empty: every prefix is at least as long as its input")
    return sorted(set(grid))


def run_args(args: argparse.Namespace) -> int:
    """``tutti profile`` with its flags parsed."""
    import statistics

    import torch

    from tutti_cluster import TuttiStore
    from tutti_cluster.bench.runner import _resolve_device
    from tutti_cluster.config import config_arguments, load_config
    from tutti_cluster.pipeline.harness import _Timer
    from tutti_cluster.pipeline.model import Decoder, PagedKV, model_shape

    cfg = load_config(**config_arguments(args, PROFILE_CONFIG_FIELDS))
    device = _resolve_device(args.device)
    cpu = device.type == "cpu"
    if args.repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    if args.model_layers is not None and args.model_layers <= 0:
        raise ConfigError("--model-layers must be positive")
    shape = model_shape(args.model or ("tiny" if cpu else "llama3-8b"), args.model_layers)
    grid = _grid(args, cfg.unit_tokens, cpu)
    io_sms = 0 if cpu else cfg.io_sms
    key = profile_key(shape.key(), device_name(device), io_sms)
    out = args.out or cfg.data_dir / "profiles" / (
        f"{shape.name}-{key['gpu'].replace(' ', '_')}-{io_sms}sm.json")
    n_max = max(n for n, _ in grid)
    bt = shape.block_tokens
    kv = PagedKV(shape, -(-n_max // bt), device)
    model = Decoder(shape, device, seed=args.seed, attention=args.attention)
    stream: Any = None
    store: Any = None
    tmp = None
    sms: dict[str, int] | None = None
    try:
        if not cpu:
            # A store of one unit's room only for its compute partition: the SMs the I/O kernel leaves.
            base = cfg.storage_paths()[0]
            base.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix="tutti-profile-", dir=base))
            store = TuttiStore(load_config(**{**cfg.model_dump(), "paths": [tmp], "capacity_gb": [0.25],
                                              "backend": "cuda", "instance": f"profile{os.getpid()}",
                                              "prewrite_pool": False}))
            store.register_kv_caches(kv.layers, block_tokens=bt, layout="kv_first")
            h = store.compute_stream()
            if h:
                stream = torch.cuda.ExternalStream(h)
            props = torch.cuda.get_device_properties(device)
            sms = {"total": props.multi_processor_count, "io": io_sms,
                   "compute": props.multi_processor_count - io_sms if h else props.multi_processor_count}
        points = []
        from tqdm import tqdm

        for n, p in tqdm(grid, desc="tutti profile", unit="point", dynamic_ncols=True):
            tokens = torch.randint(0, shape.vocab, (n,), generator=torch.Generator().manual_seed(args.seed))
            ids = torch.arange(n // bt)
            runs = []
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with ctx:
                model.prefill(kv, tokens, p, ids, layers=1)  # compile this shape first
                for _ in range(args.repeat):
                    timer = _Timer(shape.layers, not cpu)
                    model.prefill(kv, tokens, p, ids, timer)
                    runs.append(timer.seconds())
            layer_ms = [round(statistics.median(r[i] for r in runs) * 1e3, 4) for i in range(shape.layers)]
            points.append({"input": n, "prefix": p, "layer_ms": layer_ms, "free_sms": io_sms})
    finally:
        if store is not None:
            store.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    data = {"format": FORMAT, "key": key, "layers": shape.layers, "sms": sms, "align_tokens": ALIGN,
            "grid": points}
    SlackTable(data)  # the file must read back
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    for pt in points:
        print(f"  input {pt['input']:>7}  prefix {pt['prefix']:>7}  per layer {statistics.median(pt['layer_ms']):8.3f} ms")
    print(f"wrote {out} ({len(points)} points, key {key})")
    return 0


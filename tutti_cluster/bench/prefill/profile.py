"""``tutti profile``: the offline profiler of the slack-aware scheduler.

For a model shape and an SM split (the compute partition beside the store's ``io_sms`` I/O
partition), it times each layer of a prefill with a resident prefix on a grid of (input length,
prefix length) points aligned to 32 tokens, and saves the idle windows in the file the scheduler's
table reads (:class:`~tutti_cluster.pipeline.table.SlackTable`): per grid point and layer, the
window's duration (the layer's compute time, during which the I/O partition is free) and the free
SM budget (the I/O partition's SMs), keyed by the model shape, the GPU and the SM split.

Torch is imported only when a profile runs, so ``tutti profile --help`` needs none.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tutti_cluster.bench.options import (CPU_INPUTS, DEFAULT_INPUTS, parse_tokens, prefix_for, resolve_device,
                                         split_list)
from tutti_cluster.errors import ConfigError
from tutti_cluster.pipeline.table import ALIGN, FORMAT, SlackTable, device_name, profile_key

log = logging.getLogger(__name__)

PROFILE_CONFIG_FIELDS = ("paths", "data_dir", "io_sms", "unit_tokens")


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    from tutti_cluster.config import add_config_arguments

    p = parser_class(prog="tutti profile", description="Offline profile of a model shape's per-layer compute on a "
                     "(input, prefix) grid aligned to 32 tokens, with the store's I/O partition of io_sms SMs set "
                     "aside (CUDA): the slack windows `tutti bench --pipeline --profile` schedules I/O into. "
                     "Needs PyTorch and the bench extra.")
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
    inputs = sorted({parse_tokens(t) for t in split_list(args.inputs) or (CPU_INPUTS if cpu else DEFAULT_INPUTS)})
    specs = split_list(args.prefix_tokens) or ["0%", "25%", "50%", "75%", "-1u"]
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
    from tutti_cluster.bench.extra import check_extra
    from tutti_cluster.bench.prefill.harness import LayerTimer
    from tutti_cluster.bench.prefill.model import Decoder, PagedKV, model_shape
    from tutti_cluster.config import config_arguments, load_config

    check_extra()
    cfg = load_config(**config_arguments(args, PROFILE_CONFIG_FIELDS))
    device = resolve_device(args.device)
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
                    timer = LayerTimer(shape.layers, not cpu)
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


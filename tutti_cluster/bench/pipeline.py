"""``tutti bench --pipeline``: TTFT of a model-shaped prefill whose prefix is restored from the store
layer by layer, against the HBM ideal, a naive pipeline, load-then-compute, the per-chunk baseline
and full recompute (systems of :mod:`tutti_cluster.bench.prefill.harness`), with the GPU bubble, the
crossover hit rate, write-back's effect on TTFT and inter-token latency, and the cost per 1M
generated tokens.  See docs/BENCH.md, "Pipeline".

With ``--memory-paths`` the run goes on with a second store, a memory tier (``write_back``,
``promote_hits`` 0) in front of the same paths, and runs ``ideal`` and ``tutti`` again per input
and prefix twice: ``tutti-memory-hot`` with every unit of the prefix in memory, then
``tutti-memory-cold`` with none (demoted by as many other units as the memory tier has slots,
stored and removed again), each state checked with ``TuttiStore.unit_tiers`` before and after its
runs; ``memory_tier`` in the report sets them against the first store's ``tutti`` (TTFT, ITL)
and the HBM ideal of their own phase."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tutti_cluster.bench import fsutil, machine, pipeline_tiers
from tutti_cluster.bench.args import BENCH_CONFIG_FIELDS
from tutti_cluster.bench.baselines import LayerwisePerChunk
from tutti_cluster.bench.errors import BenchVerificationError, RankFailed
from tutti_cluster.bench.options import (CPU_INPUTS, DEFAULT_INPUTS, parse_tokens, prefix_for, resolve_device,
                                         run_dirs, split_list, token_label)
from tutti_cluster.bench.prefill import harness as hz
from tutti_cluster.bench.prefill.model import Decoder, ModelShape, PagedKV, TensorParallel, model_shape
from tutti_cluster.bench.progress import Progress
from tutti_cluster.bench.tutti_system import open_store, pool_bytes_per_path
from tutti_cluster.errors import CapacityExceeded, ConfigError

logger = logging.getLogger(__name__)

GIB = 1 << 30
DEFAULT_PREFIXES = ("16K", "32K", "64K", "96K", "-1u")
CPU_PREFIXES = ("25%", "50%", "75%", "-1u")


@dataclass
class PipelinePlan:
    dirs: list[Path]
    shape: ModelShape
    inputs: list[int]
    prefixes: dict[int, list[int]]  # input -> its prefixes
    systems: list[str]
    repeat: int
    device: torch.device
    cfg: Any
    attention: str
    flex_dynamic: bool | None
    naive_ahead: int
    read_ahead: int
    iocb_ioctx: int
    tutti_reads: str
    compute_on: str
    writeback: bool
    decode_steps: int
    output_tokens: int
    prices: hz.Prices
    profile: Path | None
    baseline_threads: int
    seed: int
    capacity_gb: list[float] | None
    tp: int = 1
    tp_backend: str = "gloo"
    ranks_per_dir: int = 1  # ranks whose pools share each of ``dirs``' file systems
    memory_dirs: list[Path] = field(default_factory=list)  # --memory-paths: the memory-tier runs
    memory_capacity_gb: list[float] | None = None
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def local_shape(self) -> ModelShape:
        """One rank's share of the model (the whole model at ``tp`` 1)."""
        return self.shape.shard(self.tp)


class RankGroup:
    """The tensor-parallel ranks of one bench run, as the bench sees them: a host barrier before
    every timed run, the slowest rank's time, every rank's figures. A group of one does nothing."""

    def __init__(self, rank: int = 0, size: int = 1, group: Any = None) -> None:
        self.rank, self.size, self.group = rank, size, group

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def max(self, x: float) -> float:
        if self.size == 1:
            return x
        import torch.distributed as dist

        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t[0])

    def gather(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def rank_dirs(dirs: list[Path], rank: int, tp: int) -> list[Path]:
    """A rank's share of the storage paths: every ``tp``-th path when they divide evenly, else a
    ``rank<r>`` directory in each."""
    if tp == 1:
        return dirs
    if len(dirs) % tp == 0:
        return dirs[rank::tp]
    return [d / f"rank{rank}" for d in dirs]


def make_plan(args: argparse.Namespace) -> PipelinePlan:
    """Validates the flags of ``--pipeline``; ConfigError/DeviceError on bad input."""
    from tutti_cluster.config import config_arguments, load_config

    cfg = load_config(**config_arguments(args, BENCH_CONFIG_FIELDS))
    dirs = cfg.storage_paths()
    if not cfg.paths:
        dirs[0].mkdir(parents=True, exist_ok=True)
    for d in dirs:
        if not d.is_dir():
            raise ConfigError(f"storage path {d} is not a directory")
        if not os.access(d, os.W_OK):
            raise ConfigError(f"storage path {d} is not writable")
    device = resolve_device(args.device)
    cpu = device.type == "cpu"
    if args.model_layers is not None and args.model_layers <= 0:
        raise ConfigError("--model-layers must be positive")
    shape = model_shape(args.model or ("tiny" if cpu else "llama3-8b"), args.model_layers)
    tp = args.tp
    shape.shard(tp)  # ConfigError when the heads or the MLP do not divide
    backend = args.tp_backend
    if backend == "auto":
        backend = "gloo" if cpu else "nccl"
    if cpu and backend == "nccl":
        raise ConfigError("--tp-backend nccl needs CUDA; the CPU ranks sum with gloo")
    if tp > 1 and not cpu:
        gpus = torch.cuda.device_count()
        if gpus < tp and backend == "nccl":
            raise ConfigError(f"--tp {tp} needs {tp} GPUs, one per rank; this host has {gpus} (--tp-backend gloo "
                              "runs the ranks on shared GPUs, for testing)")
    if tp > 1 and "per-chunk" in (split_list(args.systems) or []):
        raise ConfigError("--tp: the per-chunk baseline's reader has no tensor-parallel layout; leave it out of --systems")
    unit = cfg.unit_tokens
    if unit % shape.block_tokens:
        raise ConfigError(f"unit_tokens={unit} must be a multiple of the model's {shape.block_tokens}-token blocks")
    if unit % 256:
        raise ConfigError(f"unit_tokens={unit}: the per-chunk baseline's chunks are 256 tokens; use a multiple of 256")
    inputs = sorted({parse_tokens(t) for t in split_list(args.inputs) or (CPU_INPUTS if cpu else DEFAULT_INPUTS)})
    specs = split_list(args.prefix_tokens) or list(CPU_PREFIXES if cpu else DEFAULT_PREFIXES)
    prefixes: dict[int, list[int]] = {}
    for n in inputs:
        if n <= unit or n % unit:
            raise ConfigError(f"input of {n} tokens: must be a multiple of unit_tokens={unit} above one unit")
        ps = set()
        for spec in specs:
            p = prefix_for(spec, n, unit)
            if p <= 0 or p % unit:
                raise ConfigError(f"prefix {spec!r} ({p} tokens) for an input of {n}: must be a positive multiple "
                                  f"of unit_tokens={unit}")
            if p < n:  # a prefix as long as the input leaves nothing to compute
                ps.add(p)
        if not ps:
            raise ConfigError(f"no prefix of {', '.join(specs)} is shorter than the input of {n} tokens")
        prefixes[n] = sorted(ps)
    systems = split_list(args.systems) or [x for x in hz.SYSTEMS if tp == 1 or x != "per-chunk"]
    for s in systems:
        if s not in hz.SYSTEMS:
            raise ConfigError(f"unknown pipeline system {s!r}; choose from {', '.join(hz.SYSTEMS)}")
    repeat = args.repeat if args.repeat is not None else 1
    if repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    if args.naive_ahead < 0:
        raise ConfigError("--naive-ahead must be 0 (every layer up front) or positive")
    if args.read_ahead < 0:
        raise ConfigError("--read-ahead must be 0 (as far as the window holds) or positive")
    if not 0 < args.iocb_ioctx <= 2048:
        raise ConfigError("--iocb-ioctx must be in [1, 2048]")
    decode = args.decode_steps if args.decode_steps is not None else (4 if cpu else 16)
    if decode < 0:
        raise ConfigError("--decode-steps must be non-negative")
    if args.writeback and decode == 0 and "tutti" in systems:
        raise ConfigError("--writeback flushes during decode: give --decode-steps of at least 1 (or --no-writeback)")
    if args.output_tokens <= 0:
        raise ConfigError("--output-tokens must be positive")
    if args.baseline_threads < 1:
        raise ConfigError("--baseline-threads must be at least 1")
    if args.profile is not None and tp > 1:
        raise ConfigError("--profile: `tutti profile` times the whole model on one GPU; under --tp the slack "
                          "windows come from each rank's resident run")
    if args.profile is not None and not args.profile.is_file():
        raise ConfigError(f"--profile {args.profile}: no such file (write one with `tutti profile`)")
    if cfg.memory_paths:
        if tp > 1:
            raise ConfigError("--memory-paths: the memory-tier runs are for one rank; leave out --tp")
        if "tutti" not in systems or "ideal" not in systems:
            raise ConfigError("--memory-paths: the memory-tier runs are tutti's against the ideal; keep both in --systems")
        fsutil.check_memory_tier_dirs(cfg.memory_paths)
    prices = hz.Prices(args.gpu_price_hour, args.dram_price_gb_hour, args.ssd_price_gb_hour, gpus=tp)
    return PipelinePlan(
        dirs=dirs, shape=shape, inputs=inputs, prefixes=prefixes, systems=[s for s in hz.SYSTEMS if s in systems],
        repeat=repeat, device=device, cfg=cfg, attention=args.attention,
        flex_dynamic={"static": False, "auto": None}[args.flex_compile], naive_ahead=args.naive_ahead,
        read_ahead=args.read_ahead, iocb_ioctx=args.iocb_ioctx, tutti_reads=args.tutti_reads, compute_on=args.compute_on,
        writeback=bool(args.writeback), decode_steps=decode,
        output_tokens=args.output_tokens, prices=prices, profile=args.profile,
        baseline_threads=args.baseline_threads, seed=args.seed,
        capacity_gb=list(cfg.capacity_gb) if args.capacity_gb else None, tp=tp, tp_backend=backend,
        memory_dirs=list(cfg.memory_paths),
        memory_capacity_gb=list(cfg.memory_capacity_gb) if args.memory_capacity_gb else None,
    )


def _weights_bytes(s: ModelShape) -> int:
    per_layer = s.hidden * (s.q_heads + 2 * s.kv_heads) * s.head_dim + s.q_heads * s.head_dim * s.hidden
    per_layer += 3 * s.hidden * s.ffn
    return 2 * (s.layers * per_layer + s.vocab * s.hidden)


def pool_tokens(plan: PipelinePlan) -> int:
    """Tokens of KV the store holds at most at once: an input's stored prefix plus, with write-back,
    the new units of its shortest prefix's suffix (removed after each run)."""
    unit = plan.cfg.unit_tokens
    most = 0
    for n, ps in plan.prefixes.items():
        new = (n - min(ps)) // unit * unit if plan.writeback and "tutti" in plan.systems else 0
        most = max(most, max(ps) + new)
    return most


def check_room(plan: PipelinePlan) -> None:
    """Fails early, with the numbers, when the paths or the device cannot hold the run (one rank's
    plan: its share of the model and of the paths; the ranks share the host and its file systems)."""
    n = max(plan.inputs)
    s = plan.local_shape
    kv_bytes = n * s.kv_bytes_per_token
    per_path = pool_bytes_per_path(pool_tokens(plan) * s.kv_bytes_per_token, len(plan.dirs))
    mem_bytes = sum(memory_caps(plan)) if plan.memory_dirs else 0
    if plan.memory_dirs:  # the memory-tier store's paths: the prefix and as many units as memory holds
        per_path += mem_bytes // len(plan.dirs)
        for d in plan.memory_dirs:
            if shutil.disk_usage(d).free < mem_bytes:
                raise CapacityExceeded(f"{d}: {shutil.disk_usage(d).free / GIB:.1f} GiB free, the memory tier needs "
                                       f"{mem_bytes / GIB:.1f} GiB there; pass smaller --inputs or --memory-capacity-gb")
    if "per-chunk" in plan.systems:
        per_path += -(-max(max(ps) for ps in plan.prefixes.values()) * s.kv_bytes_per_token // len(plan.dirs))
    for d in plan.dirs:
        free = shutil.disk_usage(d).free
        if free < per_path * plan.ranks_per_dir:
            raise CapacityExceeded(f"{d}: {free / GIB:.1f} GiB free, the pipeline benchmark needs "
                                   f"{per_path * plan.ranks_per_dir / GIB:.1f} GiB there for inputs of {n} tokens; "
                                   "pass smaller --inputs")
    tmpfs = sum(per_path for d in plan.dirs if fsutil.fs_type(d) in fsutil.MEMORY_FS) + mem_bytes
    host_need = plan.tp * (tmpfs + (kv_bytes + _weights_bytes(s) if plan.device.type == "cpu" else 0))
    avail = machine.meminfo_bytes("MemAvailable")
    if avail and host_need > avail:
        raise CapacityExceeded(f"{avail / GIB:.1f} GiB of memory available, the pipeline benchmark needs "
                               f"{host_need / GIB:.1f} GiB (files on memory file systems"
                               f"{', the model and its KV cache' if plan.device.type == 'cpu' else ''}); "
                               "pass smaller --inputs")
    if plan.device.type == "cuda":
        act = n * (6 * s.hidden + 2 * (s.q_heads + 2 * s.kv_heads) * s.head_dim) * 2
        act += min(n, 16384) * 3 * s.ffn * 2
        sharing = -(-plan.tp // max(1, torch.cuda.device_count()))  # ranks on this GPU (--tp-backend gloo)
        need = (_weights_bytes(s) + kv_bytes + act + 2 * GIB) * sharing
        free_dev, _ = torch.cuda.mem_get_info(plan.device)
        if free_dev < need:
            raise CapacityExceeded(f"GPU has {free_dev / GIB:.1f} GiB free, the pipeline benchmark needs about "
                                   f"{need / GIB:.1f} GiB (weights, KV of {n} tokens, activations)")


def memory_caps(plan: PipelinePlan) -> list[int]:
    """Bytes per memory path of the memory-tier runs: ``--memory-capacity-gb``, else room for the
    longest stored prefix."""
    if plan.memory_capacity_gb:
        caps = plan.memory_capacity_gb * len(plan.memory_dirs) if len(plan.memory_capacity_gb) == 1 \
            else plan.memory_capacity_gb
        return [int(c * GIB) for c in caps[:len(plan.memory_dirs)]]
    return [pool_bytes_per_path(pool_tokens(plan) * plan.local_shape.kv_bytes_per_token, len(plan.memory_dirs))
            ] * len(plan.memory_dirs)


def _open_store(plan: PipelinePlan, kv: PagedKV, dirs: list[Path], memory: list[Path] | None = None) -> Any:
    """The run's store on ``dirs``; with ``memory``, a memory tier there (``write_back``, nothing
    promoted) and each path grown by its share of the memory tier (the demoting units' room). In a
    run with ``--memory-paths`` the store without one maps no file either, so that both stores read
    ``dirs`` alike (through io_uring: beside a memory tier only its files are mapped)."""
    caps = plan.capacity_gb or [pool_bytes_per_path(pool_tokens(plan) * plan.local_shape.kv_bytes_per_token,
                                                    len(dirs)) / GIB]
    fields = plan.cfg.model_dump()
    fields.update(paths=dirs, capacity_gb=caps, instance="pipeline", memory_paths=memory or [])
    if plan.memory_dirs and not memory:
        fields["map_memory_paths"] = False
    if memory:
        mem = memory_caps(plan)
        fields.update(capacity_gb=[c + sum(mem) / len(dirs) / GIB for c in caps], write_policy="write_back",
                      memory_capacity_gb=[c / GIB for c in mem], promote_hits=0, instance="pipeline-memory")
        for d in memory:
            d.mkdir(parents=True, exist_ok=True)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return open_store(fields, kv, kv.model.block_tokens, layout="kv_first")


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def run(plan: PipelinePlan, partial: Callable[[dict[str, Any]], None] | None = None,
        group: RankGroup | None = None, tp: TensorParallel | None = None) -> dict[str, Any]:
    """Runs the pipeline benchmark; returns the report (the JSON object). Cleans up its files.
    ``partial`` gets the report so far after each input (a run cut short keeps what it measured).
    Under tensor parallelism every rank runs this with its own plan (device, paths), ``group`` and
    ``tp``; the report's times are the slowest rank's."""
    group = group or RankGroup()
    work, mem_work = run_dirs(plan.dirs), run_dirs(plan.memory_dirs)
    check_room(plan)
    store: Any = None
    reader: Any = None
    progress: Progress | None = None
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    try:
        for w in work:
            w.mkdir()
        direct = {w: fsutil.probe_direct_io(w) for w in work}
        info = machine.describe(plan.dirs, {d: direct[w] for d, w in zip(plan.dirs, work)}, plan.device)
        if plan.device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(plan.device)
        s = plan.shape
        extra_blocks = -(-plan.decode_steps // s.block_tokens) + 1
        kv = PagedKV(plan.local_shape, max(plan.inputs) // s.block_tokens + extra_blocks, plan.device)
        model = Decoder(s, plan.device, seed=plan.seed, attention=plan.attention, flex_dynamic=plan.flex_dynamic, tp=tp)
        store = _open_store(plan, kv, [w / "tutti" for w in work])
        if "per-chunk" in plan.systems:
            reader = LayerwisePerChunk(kv, [w / "per-chunk" for w in work], plan.baseline_threads)  # type: ignore[arg-type]
            for w in work:
                (w / "per-chunk").mkdir()
        def harness(store: Any, reader: Any = None) -> hz.Harness:
            return hz.Harness(model, kv, store, per_chunk=reader, naive_ahead=plan.naive_ahead,
                              read_ahead=plan.read_ahead, iocb_ioctx=plan.iocb_ioctx, seed=plan.seed,
                              tutti_reads=plan.tutti_reads, compute_stream=plan.compute_on == "partition",
                              barrier=group.barrier if group.size > 1 else None)

        h = harness(store, reader)
        if plan.profile is not None:
            from tutti_cluster.pipeline.table import SlackTable

            h.windows = SlackTable.load(plan.profile, s, plan.device, int(plan.cfg.io_sms)).windows
        # cuBLAS and the allocator start up here, not in a timed run.
        warm = h.new_case(2 * store.unit_tokens, store.unit_tokens)
        model.prefill(kv, warm.tokens, 0, warm.block_ids)
        restoring = [x for x in plan.systems if x not in ("ideal", "recompute")]
        per_p = plan.repeat * (1 + len(restoring) + (plan.writeback and "tutti" in plan.systems))
        per_p += 2 * plan.repeat if plan.memory_dirs else 0  # the memory tier's hot and cold runs
        progress = Progress(sum(1 + len(plan.prefixes[n]) * per_p for n in plan.inputs), "tutti bench --pipeline",
                            show=group.rank == 0)
        info["store"] = {"unit_tokens": store.unit_tokens, "staging_mb": plan.cfg.staging_mb,
                         "map_memory_paths": plan.cfg.map_memory_paths and not plan.memory_dirs,
                         "mapped_files": store.stats().get("mapped_files"), "total_slots": store.stats().get("total_slots"),
                         "io_sms": plan.cfg.io_sms, "compute_stream": h._stream is not None}
        info["tensor_parallel"] = {"size": plan.tp, "backend": plan.tp_backend if plan.tp > 1 else None}
        for n in plan.inputs:
            done = list(rows)

            def part(rows_n: list[dict[str, Any]]) -> None:
                if partial is not None:
                    partial(_report(plan, info, done + rows_n, summary))

            rows_n, summary[str(n)] = _run_input(plan, h, n, progress, part, group)
            rows.extend(rows_n)
            info["store"]["evictions"] = store.stats().get("evictions")
            if partial is not None:
                partial(_report(plan, info, rows, summary))
        if plan.memory_dirs:  # the same inputs again through a store with a memory tier
            store.close()
            store = None
            for w in work:
                shutil.rmtree(w / "tutti", ignore_errors=True)
            for w in mem_work:
                w.mkdir()
            store = _open_store(plan, kv, [w / "tutti-memory" for w in work], [w / "tutti-memory" for w in mem_work])
            info["memory_tier"] = {"memory_paths": [str(d) for d in plan.memory_dirs], "write_policy": "write_back",
                                   "promote_hits": 0, "memory_slots": store.stats()["memory_slots"],
                                   "memory_bytes": sum(memory_caps(plan))}
            hm = harness(store)
            for n in plan.inputs:
                rows.extend(pipeline_tiers.run_input(plan, hm, n, progress))
                if partial is not None:
                    partial(_report(plan, info, rows, summary))
    finally:
        if progress is not None:
            progress.close()
        if reader is not None:
            reader.close()
        if store is not None:
            store.close()
        for w in [*work, *mem_work]:
            shutil.rmtree(w, ignore_errors=True)
    return _report(plan, info, rows, summary)


def _report(plan: PipelinePlan, info: dict[str, Any], rows: list[dict[str, Any]], summary: dict[str, Any]) -> dict:
    extra = {"memory_tier": pipeline_tiers.figures(rows)} if plan.memory_dirs else {}
    return {**extra,
        "machine": info,
        "model": {"name": plan.shape.name, "layers": plan.shape.layers, "q_heads": plan.shape.q_heads,
                  "kv_heads": plan.shape.kv_heads, "head_dim": plan.shape.head_dim, "hidden": plan.shape.hidden,
                  "ffn": plan.shape.ffn, "kv_bytes_per_token": plan.shape.kv_bytes_per_token,
                  "attention": plan.attention, "flex_compile": "static" if plan.flex_dynamic is False else "auto"},
        "prices": {"gpu_per_hour": plan.prices.gpu_per_hour, "dram_per_gb_hour": plan.prices.dram_per_gb_hour,
                   "ssd_per_gb_hour": plan.prices.ssd_per_gb_hour, "output_tokens": plan.output_tokens},
        "results": list(rows),
        "summary": dict(summary),
    }


def _against_plain(wb: list[hz.Outcome], plain: list[hz.Outcome]) -> dict[str, Any]:
    """The write-back's decode step by step against tutti's without write-back (same prefill, same
    positions; medians over rounds per step): the steps that issued writes and the whole decode."""
    def per_step(outs: list[hz.Outcome]) -> list[float]:
        return [_median(list(ts)) for ts in zip(*(o.extra["itl_steps_s"] for o in outs))]

    w, b = per_step(wb), per_step(plain)
    flags = [any(fl) for fl in zip(*(o.extra["write_step_flags"] for o in wb))]
    steps = [i for i, f in enumerate(flags) if f]
    out: dict[str, Any] = {"write_steps": steps, "itl_plain_s": round(_median(b), 6),
                           "decode_vs_plain": round(sum(w) / sum(b) - 1, 4)}
    out["itl_vs_plain"] = round(_median(w) / _median(b) - 1, 4)
    out["write_steps_vs_plain"] = (round(sum(w[i] for i in steps) / sum(b[i] for i in steps) - 1, 4)
                                   if steps else None)
    return out


def _run_input(plan: PipelinePlan, h: hz.Harness, n: int, progress: Progress,
               partial: Callable[[list[dict[str, Any]]], None],
               group: RankGroup) -> tuple[list[dict[str, Any]], dict]:
    """One input: recompute, then every prefix, longest first (the cheap suffixes: a run cut short
    keeps the high hit rates); ``partial`` gets the rows after each prefix. Every timed figure is the
    slowest rank's."""
    s = plan.shape

    def run_one(system: str, p: int, **kw: Any) -> hz.Outcome:
        o = h.run(system, case, p, **kw)
        o.ttft_s = group.max(o.ttft_s)
        if "load_s" in o.extra:
            o.extra["load_s"] = group.max(o.extra["load_s"])
        return o

    prefixes = plan.prefixes[n]
    case = h.new_case(n, max(prefixes))
    rows: list[dict[str, Any]] = []
    if h.cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        recompute = "recompute" in plan.systems
        rec = h.prepare(case, compute=recompute)
        rec_times = [group.max(rec.ttft_s)] if rec is not None else []
        for _ in range(plan.repeat - 1 if recompute else 0):
            rec_times.append(run_one("recompute", 0).ttft_s)
        progress.step(f"{token_label(n)} recompute" if recompute else f"{token_label(n)} prefix KV (random)")
        itl = group.max(h.itl(case, plan.decode_steps))
        staging_gb = plan.cfg.staging_mb / 1024
        chunk_gb = plan.baseline_threads * 256 // s.block_tokens * s.kv_shape().block_bytes / GIB
        staging_gb *= plan.tp  # a staging area per rank
        dram = {"tutti": staging_gb, "naive": staging_gb, "load-all": staging_gb, "per-chunk": chunk_gb}
        cross_pts: list[tuple[float, float, float]] = []
        rec_s = _median(rec_times) if rec_times else None
        rec_row: dict[str, Any] | None = None
        if rec_s is not None:
            rec_row = {"input_tokens": n, "prefix_tokens": 0, "hit_rate": 0.0, "system": "recompute", "number": 6,
                       "ttft_s": round(rec_s, 5), "ttft_runs_s": [round(t, 5) for t in rec_times],
                       "rounds": len(rec_times), "matches_ideal": "not compared yet",
                       "cost_per_1m_tokens": round(hz.cost_per_million(
                           plan.prices, ttft_s=rec_s, itl_s=itl, output_tokens=plan.output_tokens, dram_gb=0.0,
                           ssd_gb=0.0), 4)}
            rows.append(rec_row)
        for p in sorted(prefixes, reverse=True):
            h.warm_up(case, p)
            runs: dict[str, list[hz.Outcome]] = {}
            for _ in range(plan.repeat):
                ideal = run_one("ideal", p)
                runs.setdefault("ideal", []).append(ideal)
                for system in plan.systems:
                    if system in ("ideal", "recompute"):
                        continue
                    # tutti decodes too: its ITL, and the write-back's ITL baseline.
                    decode = {"decode_steps": plan.decode_steps} if system == "tutti" and plan.decode_steps else {}
                    o = run_one(system, p, **decode)
                    c = hz.compare(ideal.out, o.out)
                    if not c["exact"]:
                        raise BenchVerificationError(
                            f"{system} at {n} tokens, prefix {p}: output differs from the resident run "
                            f"(max |diff| {c['max_abs_diff']:.3g}{'' if c['finite'] else ', not finite'})")
                    runs.setdefault(system, []).append(o)
                    progress.step(f"{token_label(n)} P={token_label(p)} {system}")
                    if system == "tutti" and plan.writeback:
                        o = run_one("tutti", p, writeback=True, decode_steps=plan.decode_steps)
                        if not hz.compare(ideal.out, o.out)["exact"]:
                            raise BenchVerificationError(f"tutti with write-back at {n}, prefix {p}: output differs")
                        for k in case.write_keys:  # room for the next run's new units
                            h.store.remove(k)
                        case.write_keys.clear()
                        runs.setdefault("tutti-writeback", []).append(o)
                        progress.step(f"{token_label(n)} P={token_label(p)} tutti write-back")
                progress.step(f"{token_label(n)} P={token_label(p)} ideal")
            ideal_s = _median([o.ttft_s for o in runs["ideal"]])
            hit = p / n
            prefix_gb = p * s.kv_bytes_per_token / 1e9
            for system, outs in runs.items():
                ttft = _median([o.ttft_s for o in outs])
                base = "tutti" if system == "tutti-writeback" else system
                row: dict[str, Any] = {
                    "input_tokens": n, "prefix_tokens": p, "hit_rate": round(hit, 5), "system": system,
                    "number": hz.SYSTEM_NUMBERS.get(base), "ttft_s": round(ttft, 5),
                    "ttft_runs_s": [round(o.ttft_s, 5) for o in outs],
                    "bubble_s": round(ttft - ideal_s, 5), "x_ideal": round(ttft / ideal_s, 4),
                    "matches_ideal": "bitwise", "rounds": len(outs),
                    "cost_per_1m_tokens": round(hz.cost_per_million(
                        plan.prices, ttft_s=ttft, itl_s=itl, output_tokens=plan.output_tokens,
                        dram_gb=dram.get(base, 0.0), ssd_gb=prefix_gb if base != "ideal" else 0.0), 4),
                }
                last = outs[-1].extra
                if "load_s" in last:
                    load = _median([o.extra["load_s"] for o in outs])
                    row["load_s"] = round(load, 5)
                    cross_pts.append((hit, load, ideal_s))
                for name in ("layer_ms", "pre_wait_ms", "wait_ms", "host_wait_ms", "schedule", "windows_ms",
                             "windows_from", "ahead", "threads", "host_cpu_us_per_layer"):
                    if name in last:
                        row[name] = last[name]
                if system == "tutti" and "itl_s" in last:
                    row["itl_s"] = round(_median([o.extra["itl_s"] for o in outs]), 6)
                if system == "tutti-writeback":
                    wb_itl = _median([o.extra["itl_s"] for o in outs])
                    wb_base = _median([o.extra["itl_base_s"] for o in outs])
                    row["itl_s"] = round(wb_itl, 6)
                    row["itl_base_s"] = round(wb_base, 6)  # the same steps with no I/O, right after
                    row["itl_increase"] = round(wb_itl / wb_base - 1, 4) if wb_base else None
                    row.update(_against_plain(outs, runs["tutti"]))
                    plain = _median([o.ttft_s for o in runs["tutti"]])
                    row["ttft_increase"] = round(ttft / plain - 1, 4)
                rows.append(row)
            partial(rows)
        if rec_row is not None and rec is not None:
            comp = hz.compare(rec.out, runs["ideal"][-1].out)
            rec_row.update({"matches_ideal": "within bf16" if _close(comp) else "differs",
                            "max_abs_diff_vs_ideal": comp.get("max_abs_diff")})
        tutti_bubbles = [r["bubble_s"] for r in rows if r["system"] == "tutti"]
        cross = hz.crossover_hit_rate(cross_pts)
        # Above the crossover the prefix's read outlasts the suffix's compute whatever the schedule:
        # the bubble there is the I/O time the hit rate leaves unhidden, not the pipeline's.
        hideable = [r["bubble_s"] for r in rows if r["system"] == "tutti" and (cross is None or r["hit_rate"] < cross)]
        out: dict[str, Any] = {
            "recompute_s": round(rec_s, 5) if rec_s is not None else None, "itl_s": round(itl, 6),
            "crossover_hit_rate": cross,
            "crossover_note": "tutti's whole-prefix retrieve time equals the suffix's compute time "
                              "(load-all's load phase against the ideal); null: above every hit rate measured",
            "median_bubble_s": {sy: round(_median([r["bubble_s"] for r in rows if r["system"] == sy]), 5)
                                for sy in {r["system"] for r in rows if "bubble_s" in r}},
            "tutti_median_bubble_below_crossover_s": round(_median(hideable), 5) if hideable else None,
            "read_gbps": round(h.read_bps / 1e9, 3), "write_gbps": round(h.write_bps / 1e9, 3),
        }
        if h.cuda:  # the block masks and activations must not grow like queries x keys
            out["peak_gpu_bytes"] = int(torch.cuda.max_memory_allocated())
            out["kv_cache_bytes"] = h.kv.nbytes
        # Each rank's own figures: its store's retrieve and store bandwidth, the host CPU of its
        # scheduler per layer (median over tutti's runs) and its fixed staging area.
        cpu = [r["host_cpu_us_per_layer"] for r in rows if r["system"] == "tutti" and "host_cpu_us_per_layer" in r]
        mine = {"rank": group.rank, "device": str(h.kv.device), "paths": [str(d) for d in plan.dirs],
                "read_gbps": round(h.read_bps / 1e9, 3),
                "write_gbps": round(h.write_bps / 1e9, 3), "staging_bytes": int(h.store.stats().get("staging_bytes", 0)),
                "host_cpu_us_per_layer": _median(cpu) if cpu else None,
                "peak_gpu_bytes": out.get("peak_gpu_bytes"), "kv_cache_bytes": h.kv.nbytes}
        ranks = out["ranks"] = group.gather(mine)
        if group.size > 1:  # the group's bandwidth: every rank reads its share at once
            out["read_gbps"] = round(sum(r["read_gbps"] for r in ranks), 3)
            out["write_gbps"] = round(sum(r["write_gbps"] for r in ranks), 3)
        if tutti_bubbles:
            out["tutti_max_x_ideal"] = max(r["x_ideal"] for r in rows if r["system"] == "tutti")
        return rows, out
    finally:
        h.release(case)


def _close(c: dict[str, Any]) -> bool:
    return bool(c) and c["finite"] and c["max_abs_diff"] <= hz.RECOMPUTE_RTOL * max(c["logit_scale"], 1.0)


def format_table(report: dict[str, Any]) -> str:
    head = f"{'input':>7} {'prefix':>8} {'hit %':>6} {'system':<17} {'TTFT s':>9} {'x ideal':>8} {'bubble ms':>10} {'$/1M tok':>9}"
    lines = [head, "-" * len(head)]
    order = {s: i for i, s in enumerate((*hz.SYSTEMS, "tutti-writeback", "tutti-memory-hot", "tutti-memory-cold"))}
    for r in sorted(report["results"], key=lambda r: (r["input_tokens"], r["prefix_tokens"], order.get(r["system"], 99))):
        bubble = f"{r['bubble_s'] * 1e3:10.1f}" if "bubble_s" in r else f"{'':>10}"
        xi = f"{r['x_ideal']:8.3f}" if "x_ideal" in r else f"{'':>8}"
        lines.append(f"{token_label(r['input_tokens']):>7} {token_label(r['prefix_tokens']):>8} {r['hit_rate'] * 100:6.1f} "
                     f"{r['system']:<17} {r['ttft_s']:9.4f} {xi} {bubble} {r['cost_per_1m_tokens']:9.3f}")
    for n, sm in report["summary"].items():
        cross = sm["crossover_hit_rate"]
        rec = "not run" if sm["recompute_s"] is None else f"{sm['recompute_s']:.3f} s"
        lines.append(f"input {token_label(int(n))}: recompute {rec}, ITL {sm['itl_s'] * 1e3:.2f} ms, "
                     f"read {sm['read_gbps']} GB/s, crossover hit rate "
                     f"{'above the range measured' if cross is None else f'{cross * 100:.1f} %'}"
                     + ("" if sm.get("tutti_median_bubble_below_crossover_s") is None else
                        f", tutti's median bubble below it {sm['tutti_median_bubble_below_crossover_s'] * 1e3:.1f} ms"))
        for rk in sm.get("ranks", []) if len(sm.get("ranks", [])) > 1 else []:
            cpu = "-" if rk["host_cpu_us_per_layer"] is None else f"{rk['host_cpu_us_per_layer']:.1f} us"
            peak = "" if rk.get("peak_gpu_bytes") is None else f", peak GPU memory {rk['peak_gpu_bytes'] / GIB:.1f} GiB"
            lines.append(f"  rank {rk['rank']} ({rk['device']}): read {rk['read_gbps']} GB/s, write {rk['write_gbps']} "
                         f"GB/s, host CPU per layer {cpu}, staging {rk['staging_bytes'] >> 20} MiB{peak}")
    lines += pipeline_tiers.figure_lines(report.get("memory_tier", []))
    for r in report["results"]:
        if r["system"] == "tutti-writeback":
            lines.append(f"write-back {token_label(r['input_tokens'])}/{token_label(r['prefix_tokens'])}: TTFT {r['ttft_increase'] * 100:+.1f} %, "
                         f"ITL {(r['itl_increase'] or 0) * 100:+.1f} %; against tutti's decode: ITL "
                         f"{r['itl_vs_plain'] * 100:+.1f} %, steps with writes {r['write_steps']} "
                         f"{(r['write_steps_vs_plain'] or 0) * 100:+.1f} %, whole decode "
                         f"{r['decode_vs_plain'] * 100:+.1f} %; units committed "
                         f"{r['schedule']['committed_units']}/{r['schedule']['store_units']} "
                         f"(prefill {r['schedule']['writes_in_prefill']}, decode {r['schedule']['writes_in_decode']}, "
                         f"flushed {r['schedule']['writes_flushed']} layers)")
    return "\n".join(lines)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, plan: PipelinePlan, port: int, json_path: Path | None, result: Path) -> None:
    """One tensor-parallel rank (a spawned process): its GPU, the process group, its share of the
    model and of the paths; rank 0 writes the report."""
    import signal

    import torch.distributed as dist

    # The parent stops the other ranks with SIGTERM when one fails: exit through the finally blocks,
    # which close the store and remove the run's files.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.WARNING)
    device = plan.device
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(plan.tp_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=plan.tp, timeout=timedelta(minutes=30))
    created: list[Path] = []
    try:
        # Barriers and the slowest rank's time on the host, beside the model's collectives.
        host = dist.new_group(backend="gloo") if plan.tp_backend != "gloo" else None
        group = RankGroup(rank, plan.tp, host)
        dirs = rank_dirs(plan.dirs, rank, plan.tp)
        shared = len(dirs) == len(plan.dirs)  # rank<r> directories in every path
        for d in dirs:
            if not d.exists():
                created.append(d)
                d.mkdir(parents=True)
        caps = plan.capacity_gb
        if caps and plan.tp > 1:  # --capacity-gb is per path: its share of each, or the rank's paths'
            if shared:
                caps = [c / plan.tp for c in caps]
            elif len(caps) > 1:
                caps = caps[rank::plan.tp]
        mine = replace(plan, device=device, dirs=dirs, ranks_per_dir=plan.tp if shared else 1, capacity_gb=caps)

        def write(report: dict[str, Any]) -> None:
            if json_path is not None:
                json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")

        report = run(mine, partial=write if rank == 0 else None, group=group,
                     tp=TensorParallel(rank, plan.tp, dist.all_reduce))
        if rank == 0:
            result.write_text(json.dumps(report, default=str))
    finally:
        for d in created:
            shutil.rmtree(d, ignore_errors=True)
        dist.destroy_process_group()


def run_tp(plan: PipelinePlan, json_path: Path | None) -> dict[str, Any]:
    """Runs the benchmark in ``plan.tp`` spawned processes, one per rank; returns rank 0's report.
    A rank that fails stops the others (its traceback is raised here)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="tutti-tp-") as tmp:
        result = Path(tmp) / "report.json"
        try:
            mp.start_processes(_rank_main, args=(plan, _free_port(), json_path, result), nprocs=plan.tp,
                               start_method="spawn", join=True)
        except mp.ProcessRaisedException as e:  # the rank's own error, last line of its traceback first
            lines = [x for x in str(e).strip().splitlines() if x.strip()]
            raise RankFailed(f"rank {e.error_index} failed: {lines[-1] if lines else e}\n{e}") from None
        except mp.ProcessExitedException as e:
            raise RankFailed(f"rank {e.error_index} died (exit status {e.exit_code}); the other ranks were "
                             "stopped") from None
        report: dict[str, Any] = json.loads(result.read_text())
        return report


def run_args(args: argparse.Namespace) -> int:
    """``tutti bench --pipeline`` with its flags parsed."""
    plan = make_plan(args)
    s = plan.shape
    tp = f", tensor-parallel over {plan.tp} ranks ({plan.tp_backend})" if plan.tp > 1 else ""
    print(f"tutti bench --pipeline: {s.name} ({s.layers} layers, {s.q_heads}/{s.kv_heads} heads of {s.head_dim}, "
          f"hidden {s.hidden}, FFN {s.ffn}, bf16) on {plan.device}{tp}, store on {', '.join(map(str, plan.dirs))}; "
          f"inputs {', '.join(token_label(n) for n in plan.inputs)}; systems {', '.join(plan.systems)}; "
          f"{plan.repeat} round(s)")
    def write(report: dict[str, Any]) -> None:
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")

    report = run_tp(plan, args.json) if plan.tp > 1 else run(plan, partial=write)
    print(format_table(report))
    if args.json:
        write(report)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            from tutti_cluster.bench.plot import plot_pipeline

            plot_pipeline(report, args.plot, title=f"tutti bench --pipeline: {s.name} on "
                          f"{', '.join(map(str, plan.dirs))} ({plan.device.type})")
            print(f"wrote {args.plot}")
        except ImportError as e:  # the figures are in the JSON already
            print(f"no plot: {e} (pip install matplotlib)")
    return 0

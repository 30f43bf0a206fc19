"""``tutti bench``: tutti against the per-block, per-chunk (and, on CUDA, kvikio) baselines and the
same-run hardware limits, on the configured storage paths.

Flow: check room; measure the storage (and host-to-GPU) limits at several thread counts; then for
each prefix length and each system, ``repeat`` rounds of limit write pass -> store -> clear the KV
blocks -> limit read pass -> evict caches -> retrieve into a new random block permutation -> verify
every byte.  Figures are medians over the rounds; each pass is also compared with the limit pass
measured right before it ("x beside"), which cancels the drift of a shared disk's speed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tutti_cluster.bench import fsutil, limits as limits_mod, machine
from tutti_cluster.bench.args import BENCH_CONFIG_FIELDS, SYSTEMS, build_parser
from tutti_cluster.bench.baselines import CHUNK_TOKENS, KvikioBaseline, PerBlockBaseline, PerChunkBaseline
from tutti_cluster.bench.common import BenchSystem, OpTiming, Round
from tutti_cluster.bench.extra import check_extra
from tutti_cluster.bench.kvdata import LLAMA3_8B, KVData, KVShape
from tutti_cluster.bench.options import parse_tokens, resolve_device, run_dirs, split_list
from tutti_cluster.bench.progress import Progress
from tutti_cluster.errors import CapacityExceeded, ConfigError

logger = logging.getLogger(__name__)

DEFAULT_PREFIXES = (16 << 10, 32 << 10, 64 << 10, 128 << 10)
QUICK_PREFIXES = (4 << 10, 16 << 10)
GIB = 1 << 30
MIB = 1 << 20


@dataclass
class Sample:
    gbps: float
    cpu_us_per_layer: float
    host_core_s_per_gb: float
    limit_gbps: float = 0.0  # the storage limit measured right before this pass
    call_cpu_us: tuple[float, ...] = ()  # the engine thread's CPU in each issuing call


@dataclass
class Plan:
    """Everything a run needs, resolved and checked before any work starts."""

    dirs: list[Path]
    prefixes: list[int]
    systems: list[str]
    repeat: int
    device: torch.device
    limit_bytes: int
    limit_threads: list[int]
    staging_bytes: int
    baseline_threads: int
    drop_caches: bool
    capacity_gb: list[float] | None
    cfg: Any
    memory_capacity_gb: bool = False  # --memory-capacity-gb given (else sized to the prefix)
    seed: int = 0
    shape: KVShape = LLAMA3_8B
    skipped: dict[str, str] = field(default_factory=dict)


def make_plan(args: argparse.Namespace) -> Plan:
    """Validate the arguments against the config; raises ConfigError/DeviceError on bad input."""
    from tutti_cluster.config import config_arguments, load_config

    cfg = load_config(**config_arguments(args, BENCH_CONFIG_FIELDS))
    dirs = cfg.storage_paths()
    if not cfg.paths:
        dirs[0].mkdir(parents=True, exist_ok=True)  # the embedded default's storage directory
    for d in dirs:
        if not d.is_dir():
            raise ConfigError(f"storage path {d} is not a directory")
        if not os.access(d, os.W_OK):
            raise ConfigError(f"storage path {d} is not writable")
    shape = LLAMA3_8B
    prefixes = [parse_tokens(t) for t in split_list(args.prefix_tokens)] or list(
        QUICK_PREFIXES if args.quick else DEFAULT_PREFIXES
    )
    unit = max(CHUNK_TOKENS, cfg.unit_tokens)
    for n in prefixes:
        if n <= 0 or n % CHUNK_TOKENS or n % cfg.unit_tokens:
            raise ConfigError(
                f"prefix of {n} tokens: must be a positive multiple of {CHUNK_TOKENS} (chunk) and of "
                f"unit_tokens={cfg.unit_tokens}, e.g. {unit}"
            )
    memory = all(fsutil.fs_type(d) in fsutil.MEMORY_FS for d in dirs)
    # tutti-mapped differs from tutti only on memory file systems: by default it runs there only;
    # tutti-memory runs by default where a memory tier is configured.
    systems = split_list(args.systems) or [s for s in SYSTEMS if (s != "tutti-mapped" or memory)
                                           and (s != "tutti-memory" or cfg.memory_paths)]
    for s in systems:
        if s not in SYSTEMS:
            raise ConfigError(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if "tutti-memory" in systems and not cfg.memory_paths:
        raise ConfigError("tutti-memory needs a memory tier: pass --memory-paths (tmpfs, ramfs or hugetlbfs directories)")
    fsutil.check_memory_tier_dirs(cfg.memory_paths)
    if "tutti-mapped" in systems and not memory:
        raise ConfigError("tutti-mapped maps pool files on memory file systems (tmpfs, ramfs); "
                          f"not every path of {', '.join(map(str, dirs))} is one")
    repeat = args.repeat if args.repeat is not None else 1
    if repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    if args.baseline_threads < 1:
        raise ConfigError("--baseline-threads must be at least 1")
    device = resolve_device(args.device)
    limit_gb = args.limit_gb if args.limit_gb is not None else (0.5 if args.quick else 4.0)
    if limit_gb <= 0:
        raise ConfigError("--limit-gb must be positive")
    if args.limit_buffer_mb is not None and args.limit_buffer_mb <= 0:
        raise ConfigError("--limit-buffer-mb must be positive")
    return Plan(
        dirs=dirs,
        prefixes=sorted(set(prefixes)),
        systems=[s for s in SYSTEMS if s in systems],
        repeat=repeat,
        device=device,
        limit_bytes=int(limit_gb * GIB),
        # The best of 8, 12 and 16 threads; on the CPU backend also the agent's queue depth.
        limit_threads=[8, 12, 16] if device.type == "cuda" else sorted({8, 12, 16, min(cfg.queue_depth, 64)}),
        staging_bytes=(args.limit_buffer_mb or cfg.staging_mb) * MIB,
        baseline_threads=args.baseline_threads,
        drop_caches=args.drop_caches,
        capacity_gb=list(cfg.capacity_gb) if args.capacity_gb else None,
        cfg=cfg,
        memory_capacity_gb=bool(args.memory_capacity_gb),
        seed=args.seed,
        shape=shape,
    )


def check_room(plan: Plan) -> None:
    """Fail early, with the numbers, when the paths or memory cannot hold the run."""
    from tutti_cluster.bench.tutti_system import pool_bytes_per_path

    max_bytes = plan.shape.prefix_bytes(max(plan.prefixes))
    n = len(plan.dirs)
    if plan.capacity_gb:
        caps = plan.capacity_gb * n if len(plan.capacity_gb) == 1 else plan.capacity_gb
        pool = [int(c * GIB) for c in caps]
    else:
        pool = [pool_bytes_per_path(max_bytes, n)] * n
    # The limit's files stay for the whole run; the systems' files come and go one at a time.
    per_path = [max(plan.limit_bytes, max_bytes) // n + max(-(-max_bytes // n), p) + 64 * MIB for p in pool]
    by_fs: dict[int, list[int]] = {}
    tmpfs_bytes = 0
    for d, need in zip(plan.dirs, per_path):
        by_fs.setdefault(os.stat(d).st_dev, []).append(need)
        if fsutil.fs_type(d) in fsutil.MEMORY_FS:
            tmpfs_bytes += need
    for d in plan.dirs:
        dev = os.stat(d).st_dev
        need = sum(by_fs.get(dev, []))
        by_fs.pop(dev, None)
        free = shutil.disk_usage(d).free
        if need and free < need:
            raise CapacityExceeded(
                f"{d}: {free / GIB:.1f} GiB free, the benchmark needs {need / GIB:.1f} GiB there "
                f"(prefix of {max(plan.prefixes)} tokens = {max_bytes / GIB:.1f} GiB of KV); "
                "pass smaller --prefix-tokens or more --paths"
            )
    if "tutti-memory" in plan.systems:  # its memory tier's files, one prefix (and slack) at a time
        tmpfs_bytes += pool_bytes_per_path(max_bytes, 1)
    kv_bytes = max_bytes + 2 * max_bytes // plan.shape.layers  # tensors + pool + verify buffer
    staging = plan.baseline_threads * (CHUNK_TOKENS // plan.shape.block_tokens) * plan.shape.block_bytes
    host_need = tmpfs_bytes + staging + max(plan.staging_bytes, 64 * MIB) + GIB
    if plan.device.type == "cuda":
        free_dev, _ = torch.cuda.mem_get_info(plan.device)
        dev_need = kv_bytes + staging + GIB
        if free_dev < dev_need:
            raise CapacityExceeded(
                f"GPU has {free_dev / GIB:.1f} GiB free, the benchmark needs {dev_need / GIB:.1f} GiB; "
                "pass smaller --prefix-tokens"
            )
    else:
        host_need += kv_bytes
    avail = machine.meminfo_bytes("MemAvailable")
    if avail and avail < host_need:
        raise CapacityExceeded(
            f"{avail / GIB:.1f} GiB of memory available, the benchmark needs {host_need / GIB:.1f} GiB "
            f"(KV tensors{' and tmpfs files' if tmpfs_bytes else ''} for a {max(plan.prefixes)}-token "
            "prefix); pass smaller --prefix-tokens"
        )


def _measure(fn: Callable[[Round], OpTiming], rnd: Round, nbytes: int, layers: int) -> Sample:
    p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    timing = fn(rnd)
    wall = time.perf_counter() - w0
    engine_total = time.thread_time() - t0
    process = time.process_time() - p0
    gb = nbytes / 1e9
    return Sample(
        gbps=gb / wall,
        cpu_us_per_layer=timing.engine_cpu_s / layers * 1e6,
        host_core_s_per_gb=max(0.0, process - engine_total) / gb,
        call_cpu_us=timing.call_cpu_us,
    )


def _make_system(name: str, plan: Plan, kv: KVData, work: list[Path], mem_work: list[Path]) -> BenchSystem:
    if name in ("tutti", "tutti-mapped", "tutti-memory"):
        from tutti_cluster.bench.tutti_system import TuttiSystem

        mem_caps = list(plan.cfg.memory_capacity_gb) if plan.memory_capacity_gb else None
        return TuttiSystem(kv, plan.cfg, work, plan.capacity_gb, plan.seed, mapped=name == "tutti-mapped",
                           memory=mem_work if name == "tutti-memory" else None, memory_capacity_gb=mem_caps)
    if name == "per-block":
        return PerBlockBaseline(kv, work, plan.baseline_threads)
    if name == "per-chunk":
        return PerChunkBaseline(kv, work, plan.baseline_threads)
    return KvikioBaseline(kv, work, threads=8)


def run(plan: Plan) -> dict[str, Any]:
    """Run the benchmark; returns the report (the JSON object).  Cleans up its files."""
    work, mem_work = run_dirs(plan.dirs), run_dirs(plan.cfg.memory_paths)
    if "tutti-memory" not in plan.systems:
        mem_work = []
    check_room(plan)
    systems: dict[str, BenchSystem] = {}
    page_cache: set[str] = set()
    samples: dict[tuple[str, str, int], list[Sample]] = {}
    progress: Progress | None = None
    probe: limits_mod.StorageProbe | None = None
    try:
        for w in [*work, *mem_work]:
            w.mkdir()
        direct = {w: fsutil.probe_direct_io(w) for w in work}
        for w, ok in direct.items():
            if not ok:
                print(f"note: O_DIRECT refused on {w.parent} ({fsutil.fs_type(w)}): buffered I/O there")
        info = machine.describe(plan.dirs, {d: direct[w] for d, w in zip(plan.dirs, work)}, plan.device)
        n_max = max(plan.prefixes) // plan.shape.block_tokens
        kv = KVData(plan.shape, n_max, plan.device, seed=plan.seed)
        for name in plan.systems:
            try:
                systems[name] = _make_system(name, plan, kv, work, mem_work)
            except ImportError as e:
                plan.skipped[name] = str(e)
        steps = 2 * len(plan.limit_threads) + (plan.device.type == "cuda")
        steps += len(plan.prefixes) * plan.repeat * 2 * len(systems)
        progress = Progress(steps, "tutti bench")
        max_bytes = plan.shape.prefix_bytes(max(plan.prefixes))
        probe = limits_mod.StorageProbe(
            work, direct, max(plan.limit_bytes, max_bytes), plan.staging_bytes, plan.device
        )
        lim = probe.sweep(plan.limit_threads, plan.limit_bytes, progress.step)
        for tokens in plan.prefixes:
            n = tokens // plan.shape.block_tokens
            nbytes = plan.shape.prefix_bytes(tokens)
            for name, system in systems.items():
                for r in range(plan.repeat):
                    rnd = Round(tokens, n, kv.place(n), kv.permutation(n), tag=f"{tokens}-{r}")
                    label = f"{name} {tokens // 1024}K"
                    system.prepare(rnd)
                    limit = probe.write_pass(nbytes)
                    s = _measure(system.store, rnd, nbytes, plan.shape.layers)
                    s.limit_gbps = limit
                    if "store" in system.ops:
                        samples.setdefault((name, "store", tokens), []).append(s)
                    progress.step(f"{label} store")
                    kv.clear(n)
                    limit = probe.read_pass(nbytes)
                    system.before_read(rnd)
                    if plan.drop_caches:
                        page_cache.add(fsutil.drop_caches())
                    s = _measure(system.retrieve, rnd, nbytes, plan.shape.layers)
                    s.limit_gbps = limit
                    kv.verify(n, rnd.retrieve_ids, name)
                    samples.setdefault((name, "retrieve", tokens), []).append(s)
                    system.end_round(rnd)
                    progress.step(f"{label} retrieve")
                system.release()
        stats = getattr(systems.get("tutti"), "stats", None)
        if stats:
            info["tutti_stats"] = _jsonable(stats)
    finally:
        if progress is not None:
            progress.close()
        if probe is not None:
            probe.close()
        for system in systems.values():
            try:
                system.close()
            except Exception:  # noqa: BLE001 - cleanup must go on
                logger.warning("closing %s failed", system.name, exc_info=True)
        for w in [*work, *mem_work]:
            shutil.rmtree(w, ignore_errors=True)
    info["page_cache"] = (
        "own files evicted (fadvise DONTNEED) before each read pass; drop_caches: "
        + (", ".join(sorted(page_cache)) if page_cache else "not requested")
    )
    info["limit_read_gbps_by_threads"] = lim.read_by_threads
    info["limit_write_gbps_by_threads"] = lim.write_by_threads
    info["limit_buffer_bytes"] = lim.buffer_bytes
    info["skipped"] = plan.skipped
    results = []
    for (name, op, tokens), ss in samples.items():
        results.append(
            {
                "system": name,
                "op": op,
                "prefix_tokens": tokens,
                "gbps": round(statistics.median(s.gbps for s in ss), 3),
                "cpu_us_per_layer": round(statistics.median(s.cpu_us_per_layer for s in ss), 2),
                "host_core_s_per_gb": round(statistics.median(s.host_core_s_per_gb for s in ss), 4),
                "adjacent_limit_gbps": round(statistics.median(s.limit_gbps for s in ss), 3),
                "x_adjacent_limit": round(statistics.median(s.gbps / s.limit_gbps for s in ss), 3),
                "bytes": plan.shape.prefix_bytes(tokens),
                "rounds": len(ss),
                **({"x_h2d": round(statistics.median(s.gbps for s in ss) / lim.h2d_gbps, 3)} if lim.h2d_gbps else {}),
                "verified": True,
            }
        )
        calls = sorted(c for s in ss for c in s.call_cpu_us)
        if calls:  # where the time of the layer calls goes: spread evenly or in a few slow calls
            per_call = {q: round(calls[min(len(calls) - 1, int(f * len(calls)))], 1)
                        for q, f in (("p50", 0.5), ("p90", 0.9), ("max", 1.0))}
            slowest = max(ss, key=lambda s: max(s.call_cpu_us, default=0.0)).call_cpu_us
            per_call["max_at_layer"] = slowest.index(max(slowest))
            results[-1]["cpu_us_per_call"] = per_call
    return {"machine": info, "limits": {k: round(v, 3) for k, v in lim.as_json().items()}, "results": results}


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def format_table(report: dict[str, Any]) -> str:
    """The human-readable table printed at the end of a run."""
    lim = report["limits"]
    head = (f"{'system':<12} {'op':<8} {'prefix':>7} {'GB/s':>8} {'x limit':>8} {'x beside':>9} {'cpu us/layer':>13}"
            f" {'core-s/GB':>10}")
    lines = [head, "-" * len(head)]
    order = {s: i for i, s in enumerate(SYSTEMS)}
    for r in sorted(report["results"], key=lambda r: (r["op"] != "retrieve", r["prefix_tokens"], order[r["system"]])):
        ref = lim["storage_read_gbps"] if r["op"] == "retrieve" else lim["storage_write_gbps"]
        lines.append(
            f"{r['system']:<12} {r['op']:<8} {r['prefix_tokens'] // 1024:>6}K {r['gbps']:>8.2f} "
            f"{r['gbps'] / ref:>8.2f} {r['x_adjacent_limit']:>9.2f} {r['cpu_us_per_layer']:>13.1f}"
            f" {r['host_core_s_per_gb']:>10.3f}"
        )
    parts = [f"storage read {lim['storage_read_gbps']:.2f} GB/s", f"write {lim['storage_write_gbps']:.2f} GB/s"]
    if "h2d_gbps" in lim:
        parts.append(f"host-to-GPU {lim['h2d_gbps']:.2f} GB/s")
    lines.append("limits (same run, best of the thread counts): " + ", ".join(parts))
    lines.append("  x beside: against a limit pass at the best thread count measured right before each pass")
    m = report["machine"]
    if "limit_read_gbps_by_threads" in m:
        by = lambda d: ", ".join(f"{t} thr {v:.2f}" for t, v in d.items())  # noqa: E731
        lines.append(f"  storage read by threads: {by(m['limit_read_gbps_by_threads'])}")
        lines.append(f"  storage write by threads: {by(m['limit_write_gbps_by_threads'])}")
        lines.append(f"  1 MiB requests into a {m['limit_buffer_bytes'] >> 20} MiB aligned host buffer"
                     f"{' (pinned)' if m.get('device') == 'cuda' else ''}")
    for p in m.get("paths", []):
        io = "O_DIRECT" if p["direct_io"] else "buffered I/O (O_DIRECT refused)"
        lines.append(f"  {p['path']}: {p['fs_type']}, {io}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tutti bench``; returns the process exit status."""
    return run_args(build_parser().parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    """``tutti bench`` with its flags parsed."""
    check_extra()
    if getattr(args, "pipeline", False):
        from tutti_cluster.bench.pipeline import run_args as run_pipeline

        return run_pipeline(args)
    plan = make_plan(args)
    m = plan
    print(
        f"tutti bench: Llama-3-8B KV ({m.shape.layers} layers, {m.shape.kv_heads} KV heads, head "
        f"{m.shape.head_size}, bf16, {m.shape.block_tokens}-token blocks, {m.shape.object_bytes // 1024} KiB "
        f"objects) on {', '.join(map(str, m.dirs))}, device {m.device}, prefixes "
        f"{', '.join(f'{p // 1024}K' for p in m.prefixes)}, {m.repeat} round(s)"
    )
    report = run(plan)
    print(format_table(report))
    for name, why in plan.skipped.items():
        print(f"{name}: skipped ({why})")
    print(report["machine"]["page_cache"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from tutti_cluster.bench.plot import plot

        plot(report, args.plot, title=f"tutti bench on {', '.join(map(str, m.dirs))} ({m.device.type})")
        print(f"wrote {args.plot}")
    return 0

"""``tutti bench tiers``: a skewed workload through a two-tier store (a memory tier on tmpfs in front
of the storage paths) and through a single-tier store of the same total capacity, in one run, beside
the storage and host memory limits measured in that run.

The workload: a catalogue of ``--prefixes`` prefixes of ``--prefix-units`` units each, requests
drawn from a Zipf(``--zipf``) distribution over the catalogue (seeded: both systems see the same
sequence). The hot set (the most popular prefixes that together draw half the requests) must fit the
memory tier, and the catalogue must be larger than the memory and storage tiers together, so that
the storage tier evicts and the memory tier has something to keep hot; the run refuses sizes that
break either.

Each request is what an engine does: ``lookup`` of the prefix's units, a retrieve of the leading
units found (timed: the request's restore time), then the units missing are written into their KV
blocks (the stand-in for their prefill) and stored. Every retrieved unit is checked byte for byte
(:meth:`~tutti_cluster.bench.kvdata.KVData.check`). Each system runs ``--warmup`` requests first
(untimed), then the limit read pass beside it and, where root, a drop of the page cache, then the
``--requests`` timed ones; its counters are the differences of ``TuttiStore.stats()`` over the timed
requests.

``--figures`` measures issue 46's figures instead (:mod:`~tutti_cluster.bench.tier_figures`).

Systems:

* ``tiered``: ``memory_paths`` (default: a directory on /dev/shm) with ``memory_capacity_gb`` in front
  of ``--paths`` with ``capacity_gb``, the configured ``write_policy`` and promotion settings.
* ``single``: ``--paths`` alone, each path's capacity grown by its share of the memory tier's bytes
  (the same total capacity).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tutti_cluster.bench.progress import Progress
from tutti_cluster.config import add_config_arguments

logger = logging.getLogger(__name__)

SYSTEMS = ("tiered", "single")
# The store settings this bench takes from the command line.
CONFIG_FIELDS = ("paths", "capacity_gb", "direct_io", "pool_files", "prewrite_pool", "memory_paths",
                 "memory_capacity_gb", "write_policy", "promote_hits", "promote_window_s", "unit_tokens",
                 "queue_depth", "staging_mb", "map_memory_paths", "copy_engine_mb")
DEFAULT_STORAGE_GB = 2.0
DEFAULT_MEMORY_ROOT = Path("/dev/shm")
HOT_SHARE = 0.5  # the hot set: the most popular prefixes that draw this share of the requests
GIB = 1 << 30
MIB = 1 << 20
# Catalogue unit g's key: distinct, nonzero, spread over the 63-bit key space.
_KEY_MUL = 0x9E3779B97F4A7C15


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
                 prog: str = "tutti bench tiers") -> argparse.ArgumentParser:
    p = parser_class(
        prog=prog,
        description="A Zipf-skewed prefix workload (lookup, retrieve the hits, store the misses) through a "
        "store with a memory tier (tmpfs) in front of the storage paths and through a single-tier store of "
        "the same total capacity: hits per tier, restore time per request, bytes read per tier, flushes, "
        "promotions and demotions, beside the storage read and host memory copy limits of the same run. "
        "Needs PyTorch and the bench extra. See docs/BENCH.md, Tiers.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks on errors")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto",
                   help="where the KV cache lives: cpu (the CPU backend) or cuda [default: auto]")
    p.add_argument("--systems", default=",".join(SYSTEMS), metavar="LIST",
                   help=f"comma-separated subset of {','.join(SYSTEMS)}, run in this order [default: all]")
    p.add_argument("--prefixes", type=int, default=64, metavar="N", help="prefixes in the catalogue [default: 64]")
    p.add_argument("--prefix-units", type=int, default=4, metavar="N", help="units per prefix [default: 4]")
    p.add_argument("--zipf", type=float, default=1.1, metavar="S",
                   help="Zipf exponent of the prefixes' popularity (rank k drawn in proportion to k^-S) [default: 1.1]")
    p.add_argument("--requests", type=int, default=500, metavar="N", help="timed requests per system [default: 500]")
    p.add_argument("--warmup", type=int, default=300, metavar="N",
                   help="untimed requests per system before the timed ones [default: 300]")
    p.add_argument("--layers", type=int, default=32, metavar="N",
                   help="layers of the Llama-3-8B KV shape (32: 32 MiB per 256-token unit) [default: 32]")
    p.add_argument("--limit-gb", type=float, default=1.0, metavar="GB",
                   help="bytes of the storage-limit files, and of each limit read pass [default: 1]")
    p.add_argument("--drop-caches", action=argparse.BooleanOptionalAction, default=True,
                   help="sync and drop the kernel's page cache before each timed phase (root only; a note "
                   "otherwise) [default: on]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG plot")
    add_config_arguments(p, CONFIG_FIELDS, default_notes={
        "capacity_gb": f"{DEFAULT_STORAGE_GB:g}", "memory_paths": f"a new directory in {DEFAULT_MEMORY_ROOT}"})
    from tutti_cluster.bench.tier_figures import add_arguments

    add_arguments(p)
    return p


@dataclass
class Plan:
    """A run, resolved and checked before any work starts."""

    cfg: Any
    dirs: list[Path]
    memory_dirs: list[Path]
    storage_caps: list[int]
    memory_caps: list[int]
    systems: list[str]
    prefixes: int
    prefix_units: int
    zipf: float
    requests: int
    warmup: int
    device: Any
    shape: Any
    limit_bytes: int
    drop_caches: bool
    seed: int
    unit_bytes: int = 0
    hot_prefixes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def catalogue_units(self) -> int:
        return self.prefixes * self.prefix_units


def _caps(values: Sequence[float], n: int) -> list[int]:
    vals = list(values) * n if len(values) == 1 else list(values)
    return [int(v * GIB) for v in vals[:n]]


def zipf_weights(n: int, s: float) -> Any:
    """Popularity of ranks 1..n under Zipf(s), normalised."""
    import numpy as np

    w = np.arange(1, n + 1, dtype=np.float64) ** -s
    return w / w.sum()


def hot_prefixes(weights: Any, share: float = HOT_SHARE) -> int:
    """How many of the most popular prefixes draw ``share`` of the requests."""
    import numpy as np

    return int(np.searchsorted(np.cumsum(weights), share - 1e-12) + 1)


def load_tiers_config(args: argparse.Namespace) -> Any:
    """The config of the flags, with a memory tier (default: in /dev/shm) on tmpfs, ramfs or hugetlbfs and
    writable directories; ConfigError otherwise."""
    from tutti_cluster.bench import fsutil
    from tutti_cluster.config import config_arguments, load_config
    from tutti_cluster.errors import ConfigError

    given = config_arguments(args, CONFIG_FIELDS)
    cfg = load_config(**given)
    if not cfg.memory_paths:  # neither the flag, the environment nor a config file names one
        if not DEFAULT_MEMORY_ROOT.is_dir():
            raise ConfigError(f"no {DEFAULT_MEMORY_ROOT} here: pass --memory-paths on a tmpfs, ramfs or hugetlbfs")
        cfg = load_config(**given, memory_paths=str(DEFAULT_MEMORY_ROOT))
    dirs = cfg.storage_paths()
    if not cfg.paths:
        dirs[0].mkdir(parents=True, exist_ok=True)  # the embedded default's storage directory
    for d in [*dirs, *cfg.memory_paths]:
        if not d.is_dir():
            raise ConfigError(f"path {d} is not a directory")
        if not os.access(d, os.W_OK):
            raise ConfigError(f"path {d} is not writable")
    fsutil.check_memory_tier_dirs(cfg.memory_paths)
    return cfg


def make_plan(args: argparse.Namespace) -> Plan:
    """Validates the flags against the config; ConfigError (or DeviceError) on bad input."""
    from tutti_cluster.bench.kvdata import LLAMA3_8B, KVShape
    from tutti_cluster.bench.options import resolve_device
    from tutti_cluster.errors import ConfigError

    cfg = load_tiers_config(args)
    dirs = cfg.storage_paths()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ConfigError(f"unknown systems {bad}; choose from {','.join(SYSTEMS)}")
    for name, v, low in (("--prefixes", args.prefixes, 1), ("--prefix-units", args.prefix_units, 1),
                         ("--requests", args.requests, 1), ("--warmup", args.warmup, 0), ("--layers", args.layers, 1)):
        if v < low:
            raise ConfigError(f"{name} must be at least {low}")
    if not args.zipf > 0:
        raise ConfigError("--zipf must be positive")
    if not args.limit_gb > 0:
        raise ConfigError("--limit-gb must be positive")
    shape = KVShape(layers=args.layers)
    if cfg.unit_tokens % shape.block_tokens:
        raise ConfigError(f"unit_tokens ({cfg.unit_tokens}) must be a multiple of {shape.block_tokens}-token blocks")
    storage_caps = _caps(cfg.capacity_gb if args.capacity_gb is not None else [DEFAULT_STORAGE_GB], len(dirs))
    memory_caps = cfg.memory_capacity_bytes()
    plan = Plan(
        cfg=cfg, dirs=dirs, memory_dirs=list(cfg.memory_paths), storage_caps=storage_caps, memory_caps=memory_caps,
        systems=list(dict.fromkeys(systems)), prefixes=args.prefixes, prefix_units=args.prefix_units, zipf=args.zipf,
        requests=args.requests, warmup=args.warmup, device=resolve_device(args.device), shape=shape,
        limit_bytes=int(args.limit_gb * GIB), drop_caches=args.drop_caches, seed=args.seed,
        unit_bytes=shape.prefix_bytes(cfg.unit_tokens),
    )
    if shape != LLAMA3_8B:
        plan.notes.append(f"KV shape: Llama-3-8B's layer with {shape.layers} layers")
    total = sum(storage_caps) + sum(memory_caps)
    catalogue = plan.catalogue_units * plan.unit_bytes
    if catalogue <= total:
        raise ConfigError(
            f"the catalogue ({plan.prefixes} prefixes x {plan.prefix_units} units x {plan.unit_bytes / MIB:g} MiB = "
            f"{catalogue / GIB:.2f} GiB) must be larger than the memory and storage tiers together "
            f"({total / GIB:.2f} GiB): pass more --prefixes or smaller capacities")
    plan.hot_prefixes = hot_prefixes(zipf_weights(plan.prefixes, plan.zipf))
    hot = plan.hot_prefixes * plan.prefix_units * plan.unit_bytes
    if hot >= sum(memory_caps):
        raise ConfigError(
            f"the hot set (the {plan.hot_prefixes} most popular prefixes, {HOT_SHARE:.0%} of the requests: "
            f"{hot / GIB:.2f} GiB) must be smaller than the memory tier ({sum(memory_caps) / GIB:.2f} GiB): "
            "pass a larger --memory-capacity-gb, a steeper --zipf or fewer --prefix-units")
    return plan


def check_room(plan: Plan) -> None:
    """CapacityExceeded, with the numbers, when a path or host memory cannot hold the run."""
    from tutti_cluster.bench import machine
    from tutti_cluster.errors import CapacityExceeded

    n = len(plan.dirs)
    extra = sum(plan.memory_caps) // n if "single" in plan.systems else 0
    need: dict[int, tuple[Path, int]] = {}
    for d, cap in zip(plan.dirs, plan.storage_caps):  # systems run one after another: the larger pool
        dev = os.stat(d).st_dev
        prev = need.get(dev, (d, 0))[1]
        need[dev] = (d, prev + cap + extra + plan.limit_bytes // n + 64 * MIB)
    for d, cap in zip(plan.memory_dirs, plan.memory_caps):
        dev = os.stat(d).st_dev
        need[dev] = (d, need.get(dev, (d, 0))[1] + cap + 64 * MIB)
    for d, nbytes in need.values():
        free = shutil.disk_usage(d).free
        if free < nbytes:
            raise CapacityExceeded(f"{d}: {free / GIB:.2f} GiB free, the benchmark needs {nbytes / GIB:.2f} GiB there; "
                                   "pass smaller capacities or --limit-gb")
    kv = plan.prefix_units * plan.unit_bytes * 2
    host = sum(plan.memory_caps) + 64 * MIB * 2 * min(os.cpu_count() or 1, 16) + GIB
    if plan.device.type == "cpu":
        host += kv
    avail = machine.meminfo_bytes("MemAvailable")
    if avail and avail < host:
        raise CapacityExceeded(f"{avail / GIB:.1f} GiB of memory available, the benchmark needs {host / GIB:.1f} GiB "
                               "(the memory tier, the KV cache, the copy-limit buffers)")


def unit_key(unit: int) -> int:
    return ((unit + 1) * _KEY_MUL) & ((1 << 63) - 1)


def _open_store(name: str, plan: Plan, kv: Any, dirs: list[Path], mem: list[Path]) -> Any:
    """The system's store on ``dirs`` (and, tiered, the memory tier on ``mem``), KV registered."""
    from tutti_cluster.bench.tutti_system import open_store

    fields = plan.cfg.model_dump()
    for d in [*dirs, *mem]:
        d.mkdir()
    if name == "tiered":
        fields.update(paths=dirs, capacity_gb=[c / GIB for c in plan.storage_caps], memory_paths=mem,
                      memory_capacity_gb=[c / GIB for c in plan.memory_caps])
    else:
        share = sum(plan.memory_caps) / len(dirs)
        fields.update(paths=dirs, capacity_gb=[(c + share) / GIB for c in plan.storage_caps], memory_paths=[],
                      write_policy="write_back")
    fields["instance"] = f"bench-tiers-{name}"
    return open_store(fields, kv, kv.shape.block_tokens)


@dataclass
class RequestTiming:
    prefix: int
    hit_units: int
    restore_s: float
    store_s: float


class Engine:
    """One store driven as an engine drives it, over the catalogue's units."""

    def __init__(self, name: str, store: Any, kv: Any, plan: Plan) -> None:
        import numpy as np

        self.name, self.store, self.kv, self.plan = name, store, kv, plan
        self.ub = int(store.unit_blocks)
        self._rng = np.random.default_rng(plan.seed ^ 0x71E5)  # block ids: the same for every system

    def _sync(self) -> None:
        if self.kv.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.kv.device)

    def request(self, prefix: int) -> RequestTiming:
        import torch

        from tutti_cluster.bench.errors import BenchVerificationError

        P, ub, kv, store = self.plan.prefix_units, self.ub, self.kv, self.store
        units = [prefix * P + j for j in range(P)]
        keys = [unit_key(u) for u in units]
        ids = torch.from_numpy(self._rng.permutation(P * ub))
        hit = store.lookup(keys)
        restore_s = store_s = 0.0
        if hit:
            kv.clear_blocks(ids[:hit * ub])  # a retrieve that wrote nothing is caught
            self._sync()
            t0 = time.perf_counter()
            res = store.retrieve(keys[:hit], ids[:hit * ub].tolist())
            self._sync()
            restore_s = time.perf_counter() - t0
            if res.failed_units:
                raise BenchVerificationError(f"{self.name}: {len(res.failed_units)} of {hit} units found by the "
                                             f"lookup failed to load: {res.failures[:3]}")
            for j in range(hit):
                kv.check(ids[j * ub:(j + 1) * ub], self.name, kv.unit_offset(units[j]))
        if hit < P:
            for j in range(hit, P):  # the stand-in for the prefill of the units missing
                kv.fill(ids[j * ub:(j + 1) * ub], kv.unit_offset(units[j]))
            self._sync()
            t0 = time.perf_counter()
            res = store.store(keys[hit:], ids[hit * ub:].tolist())
            self._sync()
            store_s = time.perf_counter() - t0
            if res.failed_units:
                raise BenchVerificationError(f"{self.name}: {len(res.failed_units)} of {P - hit} units failed to "
                                             f"store: {res.failures[:3]}")
        return RequestTiming(prefix, hit, restore_s, store_s)


COUNTERS = ("lookups", "hits", "memory_hits", "storage_hits", "bytes_read", "memory_bytes_read", "bytes_written",
            "promotions", "demotions", "flushes", "flush_bytes", "flush_errors", "evictions")


def summarise(name: str, plan: Plan, timings: list[RequestTiming], before: dict[str, Any], after: dict[str, Any],
              wall_s: float) -> dict[str, Any]:
    """One system's row of the report: per-tier hits from the counters' differences over the timed
    requests, restore and store times per request."""
    import numpy as np

    d = {k: int(after[k]) - int(before[k]) for k in COUNTERS}
    units = d["lookups"]
    memory = d["memory_hits"]
    storage = d["hits"] - memory
    misses = units - d["hits"]
    restore = np.array([t.restore_s for t in timings])
    with_hits = np.array([t.restore_s for t in timings if t.hit_units])
    stores = np.array([t.store_s for t in timings if t.hit_units < plan.prefix_units])

    def dist(a: Any) -> dict[str, float]:
        if not len(a):
            return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
                "max": float(a.max())}

    restored = sum(t.hit_units for t in timings) * plan.unit_bytes
    return {
        "system": name,
        "requests": len(timings),
        "units": units,
        "hits": {"memory": memory, "storage": storage, "miss": misses},
        "hit_rate": {"memory": memory / units, "storage": storage / units, "miss": misses / units},
        "bench_hit_units": sum(t.hit_units for t in timings),
        "restore_s": dist(restore),
        "restore_s_requests_with_hits": dist(with_hits),
        "store_s": dist(stores),
        "restore_gbps": restored / restore.sum() / 1e9 if restore.sum() > 0 else None,
        "bytes_read": {"memory": d["memory_bytes_read"], "storage": d["bytes_read"] - d["memory_bytes_read"]},
        "bytes_written": d["bytes_written"],
        "promotions": d["promotions"], "demotions": d["demotions"], "flushes": d["flushes"],
        "flush_bytes": d["flush_bytes"], "flush_errors": d["flush_errors"], "evictions": d["evictions"],
        "flush_backlog_end": int(after["flush_backlog"]),
        "memory_units_end": int(after["memory_units"]), "units_end": int(after["units"]),
        "slots": {"memory": int(after["memory_slots"]), "total": int(after["total_slots"])},
        "wall_s": wall_s,
    }


def run(plan: Plan) -> dict[str, Any]:
    """Runs the systems one after another on the same request sequence; returns the report."""
    import numpy as np

    from tutti_cluster.bench import fsutil, limits as limits_mod, machine
    from tutti_cluster.bench.kvdata import KVData
    from tutti_cluster.bench.options import run_dirs

    work, mem_work = run_dirs(plan.dirs), run_dirs(plan.memory_dirs)
    check_room(plan)
    weights = zipf_weights(plan.prefixes, plan.zipf)
    seq = np.random.default_rng(plan.seed).choice(plan.prefixes, size=plan.warmup + plan.requests, p=weights)
    rows: list[dict[str, Any]] = []
    page_cache: list[str] = []
    probe = None
    progress = None
    try:
        for w in [*work, *mem_work]:
            w.mkdir(exist_ok=True)
        direct = {w: fsutil.probe_direct_io(w) for w in work}
        info = machine.describe([*plan.dirs, *plan.memory_dirs],
                                {d: direct[w] for d, w in zip(plan.dirs, work)}, plan.device)
        info["tiers"] = {"memory_paths": [str(d) for d in plan.memory_dirs],
                         "memory_fs": [fsutil.fs_type(d) for d in plan.memory_dirs]}
        ub = plan.cfg.unit_tokens // plan.shape.block_tokens
        kv = KVData(plan.shape, plan.prefix_units * ub, plan.device, seed=plan.seed,
                    extra_pool_elems=KVData.catalogue_elems(plan.shape, plan.catalogue_units))
        probe = limits_mod.StorageProbe(work, direct, plan.limit_bytes, 64 * MIB, plan.device)
        threads = sorted({8, 16, min(plan.cfg.queue_depth, 64)})
        lim = probe.sweep(threads, plan.limit_bytes)
        copy_buf = max(MIB, min(64 * MIB, plan.limit_bytes // 8))
        copy = limits_mod.host_copy_sweep(lambda _: copy_buf)
        limits = {"storage_read_gbps": lim.storage_read_gbps, "storage_write_gbps": lim.storage_write_gbps,
                  "storage_read_gbps_by_threads": lim.read_by_threads, "host_copy_gbps": max(copy.values()),
                  "host_copy_gbps_by_threads": copy}
        if lim.h2d_gbps is not None:
            limits["h2d_gbps"] = lim.h2d_gbps
        progress = Progress(len(plan.systems) * len(seq), "tutti bench tiers", unit="req")
        for name in plan.systems:
            dirs = [w / name for w in work]
            mem = [w / f"{name}-memory" for w in mem_work] if name == "tiered" else []
            store = _open_store(name, plan, kv, dirs, mem)
            try:
                eng = Engine(name, store, kv, plan)
                for c in seq[:plan.warmup]:
                    eng.request(int(c))
                    progress.step(f"{name} warm-up")
                beside = probe.read_pass(plan.limit_bytes)
                if plan.drop_caches:
                    page_cache.append(fsutil.drop_caches())
                before = store.stats()
                t0 = time.perf_counter()
                timings = []
                for c in seq[plan.warmup:]:
                    timings.append(eng.request(int(c)))
                    progress.step(f"{name} timed")
                wall = time.perf_counter() - t0
                row = summarise(name, plan, timings, before, store.stats(), wall)
                row["storage_read_gbps_beside"] = beside
                rows.append(row)
            finally:
                store.close()
                for d in [*dirs, *mem]:
                    shutil.rmtree(d, ignore_errors=True)
    finally:
        if progress is not None:
            progress.close()
        if probe is not None:
            probe.close()
        for w in [*work, *mem_work]:
            shutil.rmtree(w, ignore_errors=True)
    info["page_cache"] = ("dropped before each timed phase: " + ", ".join(sorted(set(page_cache)))
                          if page_cache else "not dropped (--no-drop-caches)")
    hot_units = plan.hot_prefixes * plan.prefix_units
    config = {
        "prefixes": plan.prefixes, "prefix_units": plan.prefix_units, "zipf": plan.zipf,
        "requests": plan.requests, "warmup": plan.warmup, "seed": plan.seed, "unit_tokens": plan.cfg.unit_tokens,
        "unit_bytes": plan.unit_bytes, "layers": plan.shape.layers, "device": plan.device.type,
        "catalogue_bytes": plan.catalogue_units * plan.unit_bytes,
        "hot_set": {"prefixes": plan.hot_prefixes, "bytes": hot_units * plan.unit_bytes, "share": HOT_SHARE},
        "memory_bytes": sum(plan.memory_caps), "storage_bytes": sum(plan.storage_caps),
        "write_policy": plan.cfg.write_policy, "promote_hits": plan.cfg.promote_hits,
        "promote_window_s": plan.cfg.promote_window_s, "paths": [str(d) for d in plan.dirs],
        "memory_paths": [str(d) for d in plan.memory_dirs], "notes": plan.notes,
        "distinct_prefixes_timed": int(len(set(seq[plan.warmup:].tolist()))),
    }
    return {"bench": "tiers", "machine": info, "config": config, "limits": limits, "results": rows}


def format_table(report: dict[str, Any]) -> str:
    c, lim = report["config"], report["limits"]
    lines = [
        f"{c['requests']} requests (after {c['warmup']} untimed) over {c['prefixes']} prefixes x {c['prefix_units']} "
        f"units of {c['unit_bytes'] / MIB:g} MiB (catalogue {c['catalogue_bytes'] / GIB:.2f} GiB), Zipf {c['zipf']:g}; "
        f"hot set {c['hot_set']['prefixes']} prefixes ({c['hot_set']['bytes'] / GIB:.2f} GiB, "
        f"{c['hot_set']['share']:.0%} of requests); memory tier {c['memory_bytes'] / GIB:.2f} GiB, storage "
        f"{c['storage_bytes'] / GIB:.2f} GiB ({c['write_policy']}, promote on hit {c['promote_hits']})",
        "| system | slots memory / all | memory hits | storage hits | misses | restore ms mean / p50 / p99 | restore "
        "ms, requests with hits | restore GB/s | store ms mean | GiB read memory / storage | promotions / demotions / "
        "flushes / evictions | storage read GB/s beside | timed phase s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["results"]:
        h, hr, rs, rh = r["hits"], r["hit_rate"], r["restore_s"], r["restore_s_requests_with_hits"]
        lines.append(
            f"| {r['system']} | {r['slots']['memory']} / {r['slots']['total']} | {h['memory']} ({hr['memory']:.1%}) | {h['storage']} ({hr['storage']:.1%}) | "
            f"{h['miss']} ({hr['miss']:.1%}) | {rs['mean'] * 1e3:.1f} / {rs['p50'] * 1e3:.1f} / {rs['p99'] * 1e3:.1f} | "
            f"{rh['mean'] * 1e3:.1f} | {r['restore_gbps'] or 0:.2f} | {r['store_s']['mean'] * 1e3:.1f} | {r['bytes_read']['memory'] / GIB:.2f} / "
            f"{r['bytes_read']['storage'] / GIB:.2f} | {r['promotions']} / {r['demotions']} / {r['flushes']} / "
            f"{r['evictions']} | {r['storage_read_gbps_beside']:.2f} | {r['wall_s']:.1f} |")
    by = ", ".join(f"{t} thread{'s' if int(t) > 1 else ''} {v:.1f}" for t, v in lim["host_copy_gbps_by_threads"].items())
    parts = [f"storage read {lim['storage_read_gbps']:.2f} GB/s (O_DIRECT where accepted), write "
             f"{lim['storage_write_gbps']:.2f}", f"host memory copy {by} GB/s"]
    if "h2d_gbps" in lim:
        parts.append(f"host-to-GPU {lim['h2d_gbps']:.1f} GB/s")
    lines.append("limits (same run): " + "; ".join(parts))
    lines.append(f"page cache: {report['machine']['page_cache']}")
    return "\n".join(lines)


def run_args(args: argparse.Namespace, emit: Callable[[str], None] = print) -> int:
    """``tutti bench tiers`` with its flags parsed."""
    from tutti_cluster.bench.extra import check_extra

    check_extra()
    if args.figures:
        from tutti_cluster.bench import tier_figures

        return tier_figures.run_args(args, load_tiers_config(args), emit)
    plan = make_plan(args)
    emit(f"tutti bench tiers: device {plan.device}, storage {', '.join(map(str, plan.dirs))}, memory tier "
         f"{', '.join(map(str, plan.memory_dirs))}, systems {','.join(plan.systems)}")
    for note in plan.notes:
        emit(f"note: {note}")
    report = run(plan)
    emit(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        emit(f"wrote {args.json}")
    if args.plot:
        from tutti_cluster.bench.plot import plot_tiers

        plot_tiers(report, args.plot, title=f"tutti bench tiers ({plan.device.type}): memory tier on "
             f"{', '.join(map(str, plan.memory_dirs))}, storage on {', '.join(map(str, plan.dirs))}")
        emit(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_args(build_parser().parse_args(argv))

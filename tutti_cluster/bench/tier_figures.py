"""``tutti bench tiers --figures``: issue 46's figures of the memory tier, each a ratio of two
figures measured in this run on this device.

* **hot set**: ``tutti-memory`` (:class:`~tutti_cluster.bench.tutti_system.TuttiSystem` with its
  memory tier on ``--memory-paths``, ``memory_only``: the units lie in memory alone, checked before
  every timed retrieve) retrieves each ``--prefix-tokens`` prefix; against the host-to-GPU limit
  (on the CPU backend: the host memory copy limit). ``tutti-mapped`` with its pool on the same
  memory paths is measured beside it: its store is the mapped store figure.
* **mixed request** (the smallest prefix): half the units of a prefix in the memory tier (every even unit), half on the
  storage tier (``--paths``; stored before the memory tier was opened), ``promote_hits`` 0; the
  memory half alone, the storage half alone, then both in one request, each into a new random
  block permutation and checked byte for byte: ``(t_memory + t_storage) / t_mixed``.
* **stores during a flush**: ``--flush-gb`` of units stored into the memory tier (``write_back``) in
  front of ``--paths``, then ``--repeat`` timed stores of the smallest prefix while the flusher
  copies that backlog to storage; the stores against ``tutti-mapped``'s store of the same prefix,
  and the flush (its bytes over the time from the first backlog store to ``flush()``'s return and
  a ``syncfs`` of the storage paths) against the storage write limit of the same run: the faster of
  the best of several thread counts of 1 MiB writes (O_DIRECT where the file system accepts it)
  right before and a pass right after in the flusher's own shape (its writes in flight and their
  size: ``limits.flush_shape``); one more 1 MiB pass right after is shown ("after the flush").

With a memory tier only its files are mapped, so storage paths on tmpfs (a stand-in for NVMe) are
read and written through io_uring, as a disk's are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tutti_cluster.bench.options import token_label

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_PREFIXES = ("16K", "128K")
CPU_PREFIXES = ("4K", "16K")
TARGETS = {"hot": 0.90, "mixed": 0.95, "store_during_flush": 0.90, "flush": 0.90}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "figures (--figures)",
        "Issue 46's figures instead of the skewed workload: a hot set read from the memory tier against the "
        "host-to-GPU limit, a request mixing tiers against its parts alone, stores into memory during a flush "
        "against the mapped store, and that flush against the storage write limit, all in one run (docs/BENCH.md, "
        "Tiers). --paths is the storage tier (a disk), --memory-paths the memory tier; --device, --layers, "
        "--limit-gb, --seed, --json and the store flags apply too.")
    g.add_argument("--figures", action="store_true", help="measure the figures instead of the skewed workload")
    g.add_argument("--prefix-tokens", nargs="+", metavar="N",
                   help=f"prefix lengths [default: {','.join(DEFAULT_PREFIXES)}; on the CPU {','.join(CPU_PREFIXES)}]")
    g.add_argument("--repeat", type=int, default=2, metavar="N", help="timed rounds per figure and prefix [default: 2]")
    g.add_argument("--flush-gb", type=float, metavar="GB",
                   help="backlog stored into the memory tier before the timed stores [default: 4; on the CPU 0.5]")


@dataclass
class FigurePlan:
    cfg: Any
    dirs: list[Path]
    memory_dirs: list[Path]
    device: Any
    shape: Any
    prefixes: list[int]
    repeat: int
    limit_bytes: int
    flush_bytes: int
    seed: int
    notes: list[str] = field(default_factory=list)

    @property
    def unit_blocks(self) -> int:
        return int(self.cfg.unit_tokens // self.shape.block_tokens)


def make_plan(args: argparse.Namespace, cfg: Any) -> FigurePlan:
    """Validates the flags of ``--figures`` against ``cfg`` (``tutti bench tiers``' config, its
    memory tier and directories checked); ConfigError (or DeviceError) on bad input."""
    from tutti_cluster.bench.kvdata import KVShape
    from tutti_cluster.bench.options import parse_tokens, resolve_device, split_list
    from tutti_cluster.errors import ConfigError

    dirs = cfg.storage_paths()
    device = resolve_device(args.device)
    if args.layers < 1:
        raise ConfigError("--layers must be at least 1")
    shape = KVShape(layers=args.layers)
    if cfg.unit_tokens % shape.block_tokens:
        raise ConfigError(f"unit_tokens ({cfg.unit_tokens}) must be a multiple of {shape.block_tokens}-token blocks")
    cpu = device.type == "cpu"
    prefixes = sorted({parse_tokens(t) for t in split_list(args.prefix_tokens) or
                       (CPU_PREFIXES if cpu else DEFAULT_PREFIXES)})
    for n in prefixes:
        if n <= 0 or n % (2 * cfg.unit_tokens):
            raise ConfigError(f"prefix of {n} tokens: must be a positive multiple of two units "
                              f"({2 * cfg.unit_tokens} tokens), half of it in each tier")
    if args.repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    if not args.limit_gb > 0:
        raise ConfigError("--limit-gb must be positive")
    flush_gb = args.flush_gb if args.flush_gb is not None else (0.5 if cpu else 4.0)
    if not flush_gb > 0:
        raise ConfigError("--flush-gb must be positive")
    plan = FigurePlan(cfg=cfg, dirs=dirs, memory_dirs=list(cfg.memory_paths), device=device, shape=shape,
                      prefixes=prefixes, repeat=args.repeat, limit_bytes=int(args.limit_gb * GIB),
                      flush_bytes=int(flush_gb * GIB), seed=args.seed)
    return plan


def check_room(plan: FigurePlan) -> None:
    """CapacityExceeded, with the numbers, when a path or host memory cannot hold the run."""
    from tutti_cluster.bench import machine
    from tutti_cluster.bench.tutti_system import pool_bytes_per_path
    from tutti_cluster.errors import CapacityExceeded

    top = plan.shape.prefix_bytes(max(plan.prefixes))
    small = plan.shape.prefix_bytes(min(plan.prefixes))
    flush_total = plan.flush_bytes + plan.repeat * small
    # Phases run one after another: the limit files stay, the largest phase's pools come and go.
    n, m = len(plan.dirs), len(plan.memory_dirs)
    disk = max(plan.limit_bytes, flush_total) // n + pool_bytes_per_path(max(top, flush_total), n)
    mem = plan.limit_bytes // m + pool_bytes_per_path(max(top, flush_total), m)
    need: dict[int, tuple[Path, int]] = {}
    for d, b in [*((d, disk) for d in plan.dirs), *((d, mem) for d in plan.memory_dirs)]:
        dev = os.stat(d).st_dev
        need[dev] = (d, need.get(dev, (d, 0))[1] + b)
    for d, b in need.values():
        free = shutil.disk_usage(d).free
        if free < b:
            raise CapacityExceeded(f"{d}: {free / GIB:.1f} GiB free, the figures need {b / GIB:.1f} GiB there; "
                                   "pass smaller --prefix-tokens, --flush-gb or --limit-gb")
    host = mem * m + GIB + (top * 2 if plan.device.type == "cpu" else 0)
    avail = machine.meminfo_bytes("MemAvailable")
    if avail and avail < host:
        raise CapacityExceeded(f"{avail / GIB:.1f} GiB of memory available, the figures need {host / GIB:.1f} GiB "
                               "(the memory tier's files, the KV cache); pass smaller --prefix-tokens or --flush-gb")


def _sync(kv: Any) -> None:
    if kv.device.type == "cuda":
        import torch

        torch.cuda.synchronize(kv.device)


def _open(plan: FigurePlan, kv: Any, name: str, dirs: list[Path], caps_bytes: int, memory: list[Path] | None = None,
          write_policy: str = "write_back") -> Any:
    """A store on ``dirs`` (and a memory tier on ``memory``), ``caps_bytes`` per path in each tier,
    the KV registered; ``promote_hits`` 0: reads move nothing."""
    from tutti_cluster.bench.tutti_system import open_store

    for d in [*dirs, *(memory or [])]:
        d.mkdir(parents=True, exist_ok=True)
    fields = plan.cfg.model_dump()
    fields.update(paths=dirs, capacity_gb=[caps_bytes / GIB], memory_paths=memory or [],
                  memory_capacity_gb=[caps_bytes / GIB], write_policy=write_policy if memory else "write_back",
                  promote_hits=0, instance=f"figures-{name}", map_memory_paths=True)
    return open_store(fields, kv, kv.shape.block_tokens)


def _timed(store: Any, kv: Any, op: str, keys: list[int], ids: list[int], what: str) -> float:
    """One retrieve or store (``op``) as an engine issues it (every layer, then every wait), in
    seconds; BenchVerificationError when a unit failed."""
    from tutti_cluster.bench.errors import BenchVerificationError

    read = op == "retrieve"
    _sync(kv)
    t0 = time.perf_counter()
    req = (store.begin_retrieve if read else store.begin_store)(keys, ids)
    for layer in range(kv.shape.layers):
        (store.retrieve_layer if read else store.store_layer)(layer, req)
    for layer in range(kv.shape.layers):
        store.wait_layer(layer, req)
    res = store.finish(req)
    _sync(kv)
    t = time.perf_counter() - t0
    done = len(keys) - len(res.failed_units) if read else len(res.committed_units)
    if res.failed_units or done != len(keys):
        raise BenchVerificationError(f"{what}: {len(keys) - done} of {len(keys)} units failed to "
                                     f"{'load' if read else 'store'}")
    return t


def hot_set(plan: FigurePlan, kv: Any, mem_work: list[Path], work: list[Path], step: Callable[[str], None]) -> list[dict]:
    """``tutti-mapped`` (pool on the memory paths) and ``tutti-memory`` (memory tier there,
    ``memory_only``) through the bench's store/retrieve round, every byte verified."""
    from tutti_cluster.bench.common import Round
    from tutti_cluster.bench.runner import _measure
    from tutti_cluster.bench.tutti_system import TuttiSystem, pool_bytes_per_path

    rows = []
    systems = [TuttiSystem(kv, plan.cfg, mem_work, None, plan.seed, mapped=True),
               # memory_only: its storage tier (--paths) holds nothing, a token capacity will do
               TuttiSystem(kv, plan.cfg, work, [pool_bytes_per_path(0, 1) / GIB], plan.seed, memory=mem_work,
                           write_policy="memory_only")]
    try:
        for tokens in plan.prefixes:
            n = tokens // plan.shape.block_tokens
            nbytes = plan.shape.prefix_bytes(tokens)
            for system in systems:
                stores, reads = [], []
                for r in range(-1, plan.repeat):  # round -1 untimed: a new pool's first pass
                    rnd = Round(tokens, n, kv.place(n), kv.permutation(n), tag=f"{tokens}-{r}")
                    system.prepare(rnd)
                    w = _measure(system.store, rnd, nbytes, plan.shape.layers).gbps
                    kv.clear(n)
                    system.before_read(rnd)  # tutti-memory: every unit in memory, or an error
                    g = _measure(system.retrieve, rnd, nbytes, plan.shape.layers).gbps
                    kv.verify(n, rnd.retrieve_ids, system.name)
                    system.end_round(rnd)
                    if r >= 0:
                        stores.append(w)
                        reads.append(g)
                        step(f"hot set {token_label(tokens)} {system.name}")
                system.release()
                rows.append({"system": system.name, "prefix_tokens": tokens, "bytes": nbytes,
                             "store_gbps": round(statistics.median(stores), 3),
                             "retrieve_gbps": round(statistics.median(reads), 3),
                             "store_gbps_runs": [round(x, 3) for x in stores],
                             "retrieve_gbps_runs": [round(x, 3) for x in reads]})
    finally:
        for system in systems:
            system.close()
    return rows


def mixed_request(plan: FigurePlan, kv: Any, mem_work: list[Path], work: list[Path],
                  step: Callable[[str], None]) -> list[dict]:
    """Every odd unit stored on the storage tier by a store with no memory tier, every even unit
    into the memory tier of the same store reopened with one (``memory_only``); then each half
    alone and both in one request, in turn."""
    import numpy as np

    from tutti_cluster.bench import fsutil
    from tutti_cluster.bench.tutti_system import check_tiers, pool_bytes_per_path

    ub = plan.unit_blocks
    rows = []
    rng = np.random.default_rng(plan.seed ^ 0x3D)
    for tokens in plan.prefixes[:1]:  # the smallest prefix: the storage half's reads are the disk's
        n = tokens // plan.shape.block_tokens
        units = n // ub
        keys = [int(k) for k in rng.integers(1, 2**63 - 1, size=units)]
        parts = {"memory": list(range(0, units, 2)), "storage": list(range(1, units, 2))}
        parts["mixed"] = list(range(units))
        blocks = kv.permutation(n)

        def ids_of(us: list[int], ids: Any) -> list[int]:
            return [int(b) for u in us for b in ids[u * ub:(u + 1) * ub]]

        for u in range(units):  # unit u's contents: a one-unit prefix at its own place in the pool
            kv.fill(blocks[u * ub:(u + 1) * ub], kv.unit_offset(u))
        dirs = [w / "mixed" for w in work]
        mem = [w / "mixed" for w in mem_work]
        cap = pool_bytes_per_path(plan.shape.prefix_bytes(tokens), 1)
        times: dict[str, list[float]] = {k: [] for k in parts}
        try:
            with _open(plan, kv, "mixed", dirs, cap) as s:
                _timed(s, kv, "store", [keys[u] for u in parts["storage"]], ids_of(parts["storage"], blocks), "mixed")
            with _open(plan, kv, "mixed", dirs, cap, memory=mem, write_policy="memory_only") as s:
                _timed(s, kv, "store", [keys[u] for u in parts["memory"]], ids_of(parts["memory"], blocks), "mixed")
                where = {"memory": ("memory",), "storage": ("storage",)}
                for part, want in where.items():
                    check_tiers(s, [keys[u] for u in parts[part]], want, f"mixed request, {part} half")
                for r in range(-1, plan.repeat):  # round -1 untimed: the pools' first reads
                    order = ["memory", "storage", "mixed"]
                    order = order[r % 3:] + order[:r % 3]  # no part always first
                    for part in order:
                        us = parts[part]
                        out = kv.permutation(n)
                        kv.clear(n)
                        fsutil.evict(p for d in dirs for p in d.iterdir() if p.is_file())
                        t = _timed(s, kv, "retrieve", [keys[u] for u in us], ids_of(us, out), f"mixed request, {part}")
                        if r >= 0:
                            times[part].append(t)
                        for u in us:  # unit u lands where it lies in the whole prefix
                            kv.check(out[u * ub:(u + 1) * ub], f"mixed request, {part}", kv.unit_offset(u))
                    if r >= 0:
                        step(f"mixed {token_label(tokens)}")
                for part, want in where.items():  # promote_hits 0: the reads moved nothing
                    check_tiers(s, [keys[u] for u in parts[part]], want, f"mixed request, {part} half after reads")
        finally:
            for d in [*dirs, *mem]:
                shutil.rmtree(d, ignore_errors=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios = [(m + st) / x for m, st, x in zip(times["memory"], times["storage"], times["mixed"])]
        rows.append({"prefix_tokens": tokens, "units": units, "bytes": plan.shape.prefix_bytes(tokens),
                     "t_memory_s": round(med["memory"], 9), "t_storage_s": round(med["storage"], 9),
                     "t_mixed_s": round(med["mixed"], 9), "x_parts": round((med["memory"] + med["storage"]) /
                                                                          med["mixed"], 4),
                     "x_parts_runs": [round(x, 4) for x in ratios],
                     "runs_s": {k: [round(x, 9) for x in v] for k, v in times.items()}})
    return rows


def stores_during_flush(plan: FigurePlan, kv: Any, mem_work: list[Path], work: list[Path], probe: Any,
                        flush_writes: tuple[int, int], step: Callable[[str], None]) -> dict[str, Any]:
    """The backlog, then the timed stores while the flusher copies it, then the flush's end; then a
    write pass in ``flush_writes``, the flusher's shape (writes in flight, bytes each)."""
    import numpy as np

    from tutti_cluster.bench import fsutil
    from tutti_cluster.bench.tutti_system import check_tiers, pool_bytes_per_path

    tokens = min(plan.prefixes)
    n = tokens // plan.shape.block_tokens
    ub = plan.unit_blocks
    nbytes = plan.shape.prefix_bytes(tokens)
    batches = max(1, -(-plan.flush_bytes // nbytes))
    total_units = (batches + plan.repeat) * (n // ub)
    unit_bytes = plan.shape.prefix_bytes(plan.cfg.unit_tokens)
    dirs = [w / "flush" for w in work]
    mem = [w / "flush" for w in mem_work]
    rng = np.random.default_rng(plan.seed ^ 0xF1)

    def new_keys() -> list[int]:
        return [int(k) for k in rng.integers(1, 2**63 - 1, size=n // ub)]

    ids = kv.place(n).tolist()
    keys: list[int] = []
    try:
        cap = pool_bytes_per_path(total_units * unit_bytes * 5 // 4, max(len(dirs), len(mem)))
        with _open(plan, kv, "flush", dirs, cap, memory=mem) as s:
            t0 = time.perf_counter()
            for _ in range(batches):
                keys += (k := new_keys())
                _timed(s, kv, "store", k, ids, "flush backlog")
            step(f"flush backlog {batches * nbytes / GIB:.2f} GiB")
            timed, backlog = [], []
            for _ in range(plan.repeat):
                before = int(s.stats()["flush_backlog"])
                keys += (k := new_keys())
                timed.append(nbytes / _timed(s, kv, "store", k, ids, "store during flush") / 1e9)
                backlog.append((before, int(s.stats()["flush_backlog"])))
            step(f"stores during the flush, {token_label(tokens)}")
            if not s.flush(timeout_s=1800):
                raise TimeoutError("the memory tier's flush did not end within 1800 s")
            for d in dirs:  # on the device, as the limit's write passes are (they end with fdatasync)
                fsutil.syncfs(d)
            flush_s = time.perf_counter() - t0
            st = s.stats()
            check_tiers(s, keys, ("both",), "stores during flush")
        step("flush done")
        flushed = int(st["flush_bytes"])
        beside = probe.write_pass(flushed)
        threads, request = flush_writes
        shaped = probe.write_pass(flushed, threads=threads, request=request)
    finally:
        for d in [*dirs, *mem]:
            shutil.rmtree(d, ignore_errors=True)
    return {"prefix_tokens": tokens, "backlog_bytes": batches * nbytes, "timed_bytes": plan.repeat * nbytes,
            "store_gbps": round(statistics.median(timed), 3), "store_gbps_runs": [round(x, 3) for x in timed],
            "flush_backlog_around_stores": backlog,
            "flush_running": all(b > 0 and a > 0 for b, a in backlog),
            "flushes": int(st["flushes"]), "flush_errors": int(st["flush_errors"]), "flush_bytes": flushed,
            "flush_s": round(flush_s, 4), "flush_gbps": round(flushed / flush_s / 1e9, 3),
            "write_gbps_beside": round(beside, 3), "write_gbps_flush_shaped": round(shaped, 3),
            "flush_request_bytes": request}


def run(plan: FigurePlan) -> dict[str, Any]:
    """Measures the limits and the figures; returns the report. Cleans up its files."""
    from tutti_cluster.bench import fsutil, limits as limits_mod, machine
    from tutti_cluster.bench.kvdata import KVData
    from tutti_cluster.bench.options import run_dirs
    from tutti_cluster.bench.progress import Progress

    work, mem_work = run_dirs(plan.dirs), run_dirs(plan.memory_dirs)
    check_room(plan)
    probe = mem_probe = progress = None
    try:
        for w in [*work, *mem_work]:
            w.mkdir(exist_ok=True)
        direct = {w: fsutil.probe_direct_io(w) for w in work}
        info = machine.describe([*plan.dirs, *plan.memory_dirs],
                                {**{d: direct[w] for d, w in zip(plan.dirs, work)},
                                 **{d: False for d in plan.memory_dirs}}, plan.device)
        if plan.device.type == "cuda":
            import torch

            info["gpu"] = torch.cuda.get_device_name(plan.device)
        n_max = max(plan.prefixes) // plan.shape.block_tokens
        kv = KVData(plan.shape, n_max, plan.device, seed=plan.seed,
                    extra_pool_elems=KVData.catalogue_elems(plan.shape, n_max // plan.unit_blocks))
        steps = 2 + len(plan.prefixes) * plan.repeat * 2 + plan.repeat + 3
        progress = Progress(steps, "tutti bench tiers --figures")
        # The memory side's limit: host-to-GPU (pinned, the copy engine) on CUDA, a host memory copy
        # on the CPU backend, where "device" memory is host memory.
        mem_probe = limits_mod.StorageProbe(mem_work, {w: False for w in mem_work}, plan.limit_bytes,
                                            plan.cfg.staging_mb * MIB, plan.device)
        mem_lim = mem_probe.sweep([8, 16], plan.limit_bytes)
        mem_probe.close()
        mem_probe = None
        ref: dict[str, Any]
        if plan.device.type == "cuda":
            ref = {"name": "host-to-GPU", "gbps": mem_lim.h2d_gbps}
        else:
            buf = max(MIB, min(64 * MIB, plan.limit_bytes // 8))
            by = limits_mod.host_copy_sweep(lambda _: buf)
            ref = {"name": "host memory copy", "gbps": max(by.values()), "by_threads": by}
        progress.step("memory limit")
        progress.note(f"limit: {ref['name']} {ref['gbps']:.2f} GB/s")
        hot = hot_set(plan, kv, mem_work, work, progress.step)
        mixed = mixed_request(plan, kv, mem_work, work, progress.step)
        flush_writes = limits_mod.flush_shape(plan.shape.prefix_bytes(plan.cfg.unit_tokens))
        threads, request = flush_writes
        probe = limits_mod.StorageProbe(work, direct, max(plan.limit_bytes, plan.flush_bytes),
                                        plan.cfg.staging_mb * MIB, plan.device, max_request_bytes=request)
        # One writer, four, and as many as the flusher keeps in flight.
        disk = probe.sweep(sorted({1, 4, threads}), min(plan.limit_bytes, plan.flush_bytes))
        progress.step("storage limits")
        progress.note(f"limit: storage write {disk.storage_write_gbps:.2f} GB/s, read {disk.storage_read_gbps:.2f} GB/s")
        flush = stores_during_flush(plan, kv, mem_work, work, probe, flush_writes, progress.step)
    finally:
        if progress is not None:
            progress.close()
        for pr in (probe, mem_probe):
            if pr is not None:
                pr.close()
        for w in [*work, *mem_work]:
            shutil.rmtree(w, ignore_errors=True)
    limits = {"memory_ref": ref, "memory_fs_read_gbps": mem_lim.storage_read_gbps,
              "memory_fs_write_gbps": mem_lim.storage_write_gbps,
              "storage_write_gbps": disk.storage_write_gbps, "storage_read_gbps": disk.storage_read_gbps,
              "storage_write_gbps_by_threads": disk.write_by_threads,
              "storage_read_gbps_by_threads": disk.read_by_threads,
              "direct_io": {str(d): direct[w] for d, w in zip(plan.dirs, work)}}
    config = {"device": plan.device.type, "layers": plan.shape.layers, "unit_tokens": plan.cfg.unit_tokens,
              "prefixes": plan.prefixes, "repeat": plan.repeat, "flush_bytes": plan.flush_bytes,
              "paths": [str(d) for d in plan.dirs], "memory_paths": [str(d) for d in plan.memory_dirs],
              "io_sms": plan.cfg.io_sms, "staging_mb": plan.cfg.staging_mb, "copy_engine_mb": plan.cfg.copy_engine_mb,
              "notes": plan.notes}
    report = {"bench": "tiers-figures", "machine": info, "config": config, "limits": limits, "hot_set": hot,
              "mixed": mixed, "stores_during_flush": flush}
    report["figures"] = figures(report)
    return report


def figures(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures' rows: what was measured, against what, the ratio and its target."""
    lim = report["limits"]
    ref = lim["memory_ref"]
    out = []

    def row(figure: str, tokens: int | None, measured: str, against: str, ratio: float, target: str) -> None:
        out.append({"figure": figure, "prefix_tokens": tokens, "measured": measured, "against": against,
                    "ratio": round(ratio, 6), "target": TARGETS[target],
                    "met": ratio >= TARGETS[target]})

    mapped = {r["prefix_tokens"]: r for r in report["hot_set"] if r["system"] == "tutti-mapped"}
    for r in report["hot_set"]:
        if r["system"] == "tutti-memory":
            row("hot set from memory", r["prefix_tokens"], f"retrieve {r['retrieve_gbps']:.2f} GB/s",
                f"{ref['name']} {ref['gbps']:.2f} GB/s", r["retrieve_gbps"] / ref["gbps"], "hot")
    for r in report["mixed"]:
        row("mixed request", r["prefix_tokens"], f"mixed {r['t_mixed_s'] * 1e3:.1f} ms",
            f"memory {r['t_memory_s'] * 1e3:.1f} + storage {r['t_storage_s'] * 1e3:.1f} ms alone", r["x_parts"], "mixed")
    f = report["stores_during_flush"]
    m = mapped[f["prefix_tokens"]]["store_gbps"]
    row("stores during a flush", f["prefix_tokens"],
        f"store {f['store_gbps']:.2f} GB/s{'' if f['flush_running'] else ' (the flush ended before them)'}",
        f"mapped store {m:.2f} GB/s", f["store_gbps"] / m, "store_during_flush")
    limit = max(lim["storage_write_gbps"], f["write_gbps_flush_shaped"])
    row("flush to storage", None, f"{f['flush_gbps']:.2f} GB/s ({f['flush_bytes'] / GIB:.2f} GiB)",
        f"write limit {limit:.2f} GB/s (sweep {lim['storage_write_gbps']:.2f}; after the flush "
        f"{f['write_gbps_beside']:.2f}, in its {f['flush_request_bytes'] // MIB} MiB writes "
        f"{f['write_gbps_flush_shaped']:.2f})", f["flush_gbps"] / limit, "flush")
    return out


def format_table(report: dict[str, Any]) -> str:
    lines = ["| figure | prefix | measured | against (same run) | ratio | target |", "| --- | --- | --- | --- | --- | --- |"]
    for r in report["figures"]:
        size = "" if r["prefix_tokens"] is None else token_label(r["prefix_tokens"])
        lines.append(f"| {r['figure']} | {size} | {r['measured']} | {r['against']} | {r['ratio']:.3f} | "
                     f">= {r['target']:.2f}{'' if r['met'] else ' (not met)'} |")
    for r in report["hot_set"]:
        lines.append(f"  {r['system']} {token_label(r['prefix_tokens'])}: store {r['store_gbps']:.2f} GB/s, retrieve "
                     f"{r['retrieve_gbps']:.2f} GB/s")
    for note in report["config"]["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def run_args(args: argparse.Namespace, cfg: Any, emit: Callable[[str], None] = print) -> int:
    """``tutti bench tiers --figures`` with its flags parsed and their config (``cfg``) loaded."""
    plan = make_plan(args, cfg)
    emit(f"tutti bench tiers --figures: device {plan.device}, storage {', '.join(map(str, plan.dirs))}, memory tier "
         f"{', '.join(map(str, plan.memory_dirs))}, prefixes {', '.join(token_label(p) for p in plan.prefixes)}, "
         f"{plan.repeat} round(s), flush backlog {plan.flush_bytes / GIB:g} GiB")
    report = run(plan)
    emit(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        emit(f"wrote {args.json}")
    return 0

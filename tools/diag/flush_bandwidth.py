"""The memory tier's flush against the storage tier's write limit, in one run.

Stores ``--units`` GPU files of Llama-3-8B's KV shape (32 layers, K and V of 16 blocks of 16
tokens: 32 MiB each) into a memory tier on ``--memory-path`` in front of ``--path`` with
``write_policy=memory_only`` (nothing flushed yet), reopens the store with ``write_back`` (the open
finds every unit in memory only and queues its flush) and times the flush, from the open to
``flush()``'s return and a ``syncfs`` of ``--path``; then the storage write limit on the same path
(O_DIRECT, 1 MiB requests, the best of 1, 2, 4, 8 and 16 threads) over as many bytes, and a pass
in the flusher's own shape (``limits.flush_shape``: 16 writes of 8 MiB in flight here).
``--rounds N`` repeats the flush N times, each between write passes (the faster of the sweep's
best and the flusher's shape, as many bytes), and compares it with their mean: a shared virtual
disk's write rate drifts within minutes, and only passes beside the flush cancel that. Run as root
to drop the page cache before each phase:

    python tools/diag/flush_bandwidth.py --path /var/tmp/fb --memory-path /dev/shm/fb --units 48 [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from tutti_cluster import TuttiConfig, TuttiStore
from tutti_cluster.bench import fsutil, limits

LAYERS, BLOCK_TOKENS, KV_HEADS, HEAD = 32, 16, 8, 128
UNIT_BLOCKS = 16


def open_store(args: argparse.Namespace, kv: list, policy: str) -> TuttiStore:
    unit = (2 * LAYERS * UNIT_BLOCKS * BLOCK_TOKENS * KV_HEADS * HEAD * 2 + 4096) / 2**30
    cfg = TuttiConfig(paths=[args.path], capacity_gb=unit * (args.units + 2), memory_paths=[args.memory_path],
                      memory_capacity_gb=unit * (args.units + 2), write_policy=policy, promote_hits=0,
                      unit_tokens=UNIT_BLOCKS * BLOCK_TOKENS, instance="flush-diag")
    s = TuttiStore(cfg)
    s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS, layout="kv_first")
    return s


def flush_once(args: argparse.Namespace, kv: list, keys: list[int], blocks: int) -> tuple[float, float, int]:
    """Stores the units into memory only, reopens with write_back and times the flush from the
    open's start to the storage paths' syncfs; returns (seconds to open, seconds to flush, slot
    bytes). Leaves no pool files."""
    with open_store(args, kv, "memory_only") as s:
        assert s.store(keys, np.arange(blocks)).ok
        slot = s.stats()["slot_bytes"]
    fsutil.drop_caches()
    t0 = time.perf_counter()
    with open_store(args, kv, "write_back") as s:
        opened = time.perf_counter() - t0
        assert s.flush(timeout_s=600)
        fsutil.syncfs(args.path)  # on the device, as the write passes are (they end with fdatasync)
        flush_s = time.perf_counter() - t0  # from the open: its flusher starts before the open returns
        st = s.stats()
        assert st["flushes"] == args.units and s.unit_tiers(keys) == ["both"] * args.units, st
    for f in (*args.path.glob("tutti-flush-diag*.pool"), *args.memory_path.glob("tutti-flush-diag*.pool")):
        f.unlink()
    return opened, flush_s, slot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", type=Path, required=True)
    p.add_argument("--memory-path", type=Path, required=True)
    p.add_argument("--units", type=int, default=48)
    p.add_argument("--rounds", type=int, default=0,
                   help="flushes between write passes after the first flush and the sweep [default: 0]")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    for d in (args.path, args.memory_path):
        d.mkdir(parents=True, exist_ok=True)
    blocks = args.units * UNIT_BLOCKS
    gen = torch.Generator().manual_seed(1)
    kv = [torch.randint(-(1 << 15), 1 << 15, (2, blocks, BLOCK_TOKENS, KV_HEADS, HEAD), dtype=torch.int16,
                        generator=gen).view(torch.bfloat16) for _ in range(LAYERS)]
    keys = list(range(1, args.units + 1))
    opened, flush_s, slot = flush_once(args, kv, keys, blocks)
    nbytes = args.units * slot
    fsutil.drop_caches()
    direct = {args.path: fsutil.probe_direct_io(args.path)}
    threads, request = limits.flush_shape(slot)  # the flusher's writes in flight and their size
    probe = limits.StorageProbe([args.path], direct, nbytes, 64 << 20, torch.device("cpu"), max_request_bytes=request)

    def best_pass() -> float:
        return max(probe.write_pass(nbytes), probe.write_pass(nbytes, threads=threads, request=request))

    rounds = []
    try:
        lim = probe.sweep(sorted({1, 2, 4, 8, threads}), nbytes)
        shaped = probe.write_pass(nbytes, threads=threads, request=request)
        for r in range(args.rounds):
            before = best_pass()
            _, f_s, _ = flush_once(args, kv, keys, blocks)
            after = best_pass()
            gbps = nbytes / f_s / 1e9
            rounds.append({"write_before_gbps": round(before, 3), "flush_gbps": round(gbps, 3),
                           "write_after_gbps": round(after, 3), "x_mean_beside": round(2 * gbps / (before + after), 3)})
            print(f"round {r}: write {before:.2f} GB/s, flush {gbps:.2f}, write {after:.2f}: "
                  f"{rounds[-1]['x_mean_beside']:.2f}x the passes beside", flush=True)
    finally:
        probe.close()
    out = {"units": args.units, "bytes": nbytes, "open_s": round(opened, 3), "flush_s": round(flush_s, 3),
           "flush_gbps": round(nbytes / flush_s / 1e9, 3), "write_limit_gbps": round(lim.storage_write_gbps, 3),
           "write_by_threads": {k: round(v, 3) for k, v in lim.write_by_threads.items()},
           "write_flush_shaped_gbps": round(shaped, 3),
           "x_write_limit": round(nbytes / flush_s / 1e9 / max(lim.storage_write_gbps, shaped), 3),
           "direct_io": direct[args.path],
           "rounds": rounds}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    shutil.rmtree(args.memory_path, ignore_errors=True)


if __name__ == "__main__":
    main()

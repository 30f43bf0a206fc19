"""CPU host diagnostic: what O_DIRECT disk reads cost a two-thread torch loop running beside them,
by request size, with none of the store's code involved. Each round times the loop alone and with
``--mib`` of reads by fio (io_uring, queue depth 64, the page cache dropped first) started with it,
in alternating order. ``--loop memory`` streams 1.5 GiB of float32 weights through 8-row products
(memory-bound, as a short prefill tail over a large model); ``--loop cache`` multiplies 1024x1024
matrices that stay in cache (compute-bound). Needs root (drop_caches) and fio; not part of the suite.

    python tools/diag/disk_reads_beside_cpu.py FILE [--loop memory|cache] [--sizes 1M,4M] [--rounds 6]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time

import torch

from tutti_cluster.bench import fsutil


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", help="a file of at least --mib MiB on the disk under test")
    ap.add_argument("--loop", choices=("memory", "cache"), default="memory")
    ap.add_argument("--sizes", default="1M,4M", help="fio request sizes, comma-separated")
    ap.add_argument("--mib", type=int, default=258, help="MiB read per round (a restore's 258 MiB)")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("needs fio (apt-get install fio)")
    torch.set_num_threads(2)
    if a.loop == "memory":
        w, x, passes = [torch.randn(4096, 4096) for _ in range(24)], torch.randn(8, 4096), 3
    else:
        w, x, passes = [torch.randn(1024, 1024) for _ in range(4)], torch.randn(1024, 1024), 40

    def loop() -> float:
        t = time.perf_counter()
        for _ in range(passes):
            for m in w:
                torch.mm(x, m)
        return time.perf_counter() - t

    def run(bs: str | None) -> float:
        fsutil.drop_caches()
        p = None
        if bs:
            p = subprocess.Popen(["fio", "--name=r", f"--filename={a.file}", "--rw=read", f"--bs={bs}",
                                  f"--size={a.mib}M", "--direct=1", "--ioengine=io_uring", "--iodepth=64",
                                  "--output=/dev/null"])
        dt = loop()
        if p is not None and p.wait() != 0:
            raise SystemExit(f"fio failed on {a.file}")
        return dt

    loop()  # warm
    variants: list[str | None] = [None, *a.sizes.split(",")]
    res: dict[str | None, list[float]] = {v: [] for v in variants}
    for r in range(a.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            res[v].append(run(v))
    base = statistics.median(res[None])
    for v, ts in res.items():
        med = statistics.median(ts)
        extra = "" if v is None else f"  +{(med - base) * 1e3:.0f} ms"
        print(f"{v or 'alone':>6}: median {med * 1e3:7.1f} ms{extra}  ({' '.join(f'{t * 1e3:.0f}' for t in ts)})")


if __name__ == "__main__":
    main()

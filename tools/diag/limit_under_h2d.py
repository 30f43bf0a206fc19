"""The storage read limit alone and while the GPU copies from other pinned host memory.

Answers whether host memory bandwidth binds the io_uring path on a memory file system: a read from
tmpfs is a kernel copy (host memory read and written), and the GPU pulling staging over PCIe reads
host memory once more. Run on the GPU host, with a directory on /dev/shm:

    python tools/diag/limit_under_h2d.py --path /dev/shm/lim --json lim.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

from tutti_cluster.bench import limits


def h2d_loop(stop: threading.Event, nbytes: int, out: list[float]) -> None:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    moved, t0 = 0, time.perf_counter()
    with torch.cuda.stream(stream):
        while not stop.is_set():
            dst.copy_(src, non_blocking=True)
            stream.synchronize()
            moved += nbytes
    out.append(moved / (time.perf_counter() - t0) / 1e9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", type=Path, required=True)
    p.add_argument("--gb", type=float, default=4.0)
    p.add_argument("--buffer-mb", type=int, default=2048)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--json")
    a = p.parse_args()
    a.path.mkdir(parents=True, exist_ok=True)
    nbytes = int(a.gb * (1 << 30))
    probe = limits.StorageProbe([a.path], {a.path: True}, nbytes, a.buffer_mb << 20, torch.device("cuda"))
    out: dict[str, float] = {}
    try:
        probe.sweep([a.threads], nbytes, lambda *_: None)
        out["read_alone_gbps"] = probe.read_pass(nbytes)
        stop, h2d = threading.Event(), []
        t = threading.Thread(target=h2d_loop, args=(stop, 1 << 30, h2d))
        t.start()
        time.sleep(0.5)
        out["read_with_h2d_gbps"] = probe.read_pass(nbytes)
        stop.set()
        t.join()
        out["h2d_during_gbps"] = h2d[0]
        out["read_alone_again_gbps"] = probe.read_pass(nbytes)
    finally:
        probe.close()
    for k, v in out.items():
        print(f"{k}: {v:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()

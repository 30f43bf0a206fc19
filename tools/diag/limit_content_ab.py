"""Does the content of the storage-limit files change how fast a virtual disk reads them?

Two sets of limit files on one directory: A as `tutti bench` writes them (one random 1 MiB pattern,
repeated), B rewritten with distinct random data. Read passes alternate A and B (page cache dropped
before each, O_DIRECT), so that the disk's drift falls on both alike:

    python tools/diag/limit_content_ab.py --path /tmp/ab
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from tutti_cluster.bench import fsutil, limits

GIB = 1 << 30
CHUNK = 64 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", type=Path, required=True)
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    nbytes = int(a.gb * GIB)
    dirs = {name: a.path / name for name in ("repeated", "distinct")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    probes = {name: limits.StorageProbe([d], {d: True}, nbytes, CHUNK, torch.device("cpu")) for name, d in dirs.items()}
    try:
        rng = np.random.default_rng(1)
        buf = memoryview(fsutil.aligned_buffer(CHUNK))
        for fd in probes["distinct"]._fds:
            for off in range(0, os.fstat(fd).st_size, CHUNK):
                buf[:] = rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
                fsutil.write_all(fd, buf, off)
        os.sync()
        got: dict[str, list[float]] = {name: [] for name in probes}
        for r in range(a.rounds):
            order = list(probes) if r % 2 == 0 else list(reversed(probes))
            for name in order:
                fsutil.drop_caches()
                got[name].append(probes[name]._pass(a.threads, False, nbytes))
        for name, v in got.items():
            print(f"{name:>8}: {', '.join(f'{x:.2f}' for x in v)} GB/s (median {sorted(v)[len(v) // 2]:.2f})")
    finally:
        for probe in probes.values():
            probe.close()
        shutil.rmtree(a.path, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Does tutti's read order cost bandwidth on a disk, read the way the storage limit reads?

One file laid out as GPU files (`--units`, 64 by default: 2 GiB) of 32 layers x 1 MiB; 64 threads
read it with 1 MiB O_DIRECT `preadv`s (the limit's reader), either in file order or in tutti's
retrieve order (layer by layer, one 1 MiB K/V pair per unit, units 32 MiB apart). Passes alternate,
page cache dropped before each:

    python tools/diag/disk_read_order.py --path /tmp/order
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from tutti_cluster.bench import fsutil
from tutti_cluster.bench.limits import timed_threads

MIB = 1 << 20
LAYERS = 32


def timed_pass(fd: int, view: memoryview, order: Callable[[int], int], threads: int, units: int) -> float:
    total = units * LAYERS

    def work(t: int) -> None:
        for k in range(t, total, threads):
            fsutil.read_all(fd, view[(k % 64) * MIB : (k % 64 + 1) * MIB], order(k))

    fsutil.drop_caches()
    return total * MIB / timed_threads(threads, work) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", type=Path, required=True)
    p.add_argument("--threads", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--units", type=int, default=64, help="GPU files of 32 MiB")
    a = p.parse_args()
    a.path.mkdir(parents=True, exist_ok=True)
    fd = os.open(a.path / "order.dat", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        size = a.units * LAYERS * MIB
        os.posix_fallocate(fd, 0, size)
        view = memoryview(fsutil.aligned_buffer(64 * MIB))
        view[:] = os.urandom(64 * MIB)
        for off in range(0, size, 64 * MIB):
            fsutil.write_all(fd, view, off)
        os.fsync(fd)
        orders = {"file order": lambda k: k * MIB,
                  "tutti order": lambda k: (k % a.units) * LAYERS * MIB + (k // a.units) * MIB}
        got: dict[str, list[float]] = {name: [] for name in orders}
        for r in range(a.rounds):
            for name in (list(orders) if r % 2 == 0 else list(reversed(orders))):
                got[name].append(timed_pass(fd, view, orders[name], a.threads, a.units))
        for name, v in got.items():
            print(f"{name:>11}: {', '.join(f'{x:.2f}' for x in v)} GB/s")
    finally:
        os.close(fd)
        shutil.rmtree(a.path, ignore_errors=True)


if __name__ == "__main__":
    main()

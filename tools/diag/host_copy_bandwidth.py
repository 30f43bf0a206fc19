"""Host memory copy bandwidth with 1 to 16 threads (numpy copies release the GIL).

Each thread copies its own 256 MiB buffer into another, repeatedly; the figure is bytes copied per
second (each byte copied is read once and written once). Used beside the /dev/shm benchmark to see
how much of the host's memory bandwidth one extra pass over the data costs:

    python tools/diag/host_copy_bandwidth.py --json copy.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from tutti_cluster.bench.limits import timed_threads

MIB = 1 << 20


def copy_gbps(threads: int, buf_mib: int, rounds: int) -> float:
    pairs = [(np.ones(buf_mib * MIB, np.uint8), np.full(buf_mib * MIB, 2, np.uint8)) for _ in range(threads)]

    def work(t: int) -> None:
        for _ in range(rounds):
            np.copyto(pairs[t][1], pairs[t][0])

    return threads * rounds * buf_mib * MIB / timed_threads(threads, work) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,4,8,12,16")
    p.add_argument("--buf-mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--json")
    a = p.parse_args()
    out = {}
    for n in (int(x) for x in a.threads.split(",")):
        out[n] = round(copy_gbps(n, a.buf_mib, a.rounds), 2)
        print(f"{n:>3} threads: {out[n]:.2f} GB/s copied")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"copy_gbps_by_threads": out, "buf_mib": a.buf_mib}, f)


if __name__ == "__main__":
    main()

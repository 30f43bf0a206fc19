"""How long opening a store on /dev/shm takes, with and without map_memory_paths (an 8 GiB pool),
twice in one process:

    python tools/diag/open_time.py 1    # mapped
    python tools/diag/open_time.py 0    # io_uring only
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from tutti_cluster import TuttiConfig, TuttiStore


def main() -> None:
    mapped = sys.argv[1] == "1"
    d = Path(sys.argv[2] if len(sys.argv) > 2 else "/dev/shm/ot")
    d.mkdir(exist_ok=True)
    kv = [torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16) for _ in range(32)]
    for rep in range(2):
        t0 = time.perf_counter()
        s = TuttiStore(TuttiConfig(paths=[d], capacity_gb=8, map_memory_paths=mapped))
        s.register_kv_caches(kv, block_tokens=16)
        t1 = time.perf_counter()
        s.close()
        print(f"map_memory_paths={mapped} open #{rep + 1} in this process: {t1 - t0:.2f} s", flush=True)


if __name__ == "__main__":
    main()

"""One line per cell of every bench JSON under a gpu_ab.sh output folder: python3 tests/bench_summary.py OUT."""

import glob
import json
import os
import sys


def run_number(path: str) -> int:
    tail = os.path.basename(os.path.dirname(path)).rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


for f in sorted(glob.glob(sys.argv[1] + "/*/bench_*.json"), key=run_number):
    d = json.load(open(f))
    lim = d["limits"]
    print(os.path.basename(os.path.dirname(f)), os.path.basename(f),
          f"limits read {lim['storage_read_gbps']:.2f} write {lim['storage_write_gbps']:.2f} GB/s")
    for r in d["results"]:
        print(f"  {r['system']:<12} {r['op']:<8} {r['prefix_tokens'] // 1024:>4}K {r['gbps']:6.2f} GB/s"
              f" x{r['x_adjacent_limit']:.2f} cpu {r['cpu_us_per_layer']:5.1f} us/layer {r.get('cpu_us_per_call', '')}")

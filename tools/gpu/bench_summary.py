"""The bench JSONs under a gpu_ab.sh output folder: python3 tools/gpu/bench_summary.py OUT.

One line per cell of every run, then, where the folder holds runs of more than one variant (old,
new, new-NAME_VALUE), an A/B table: per cell each variant's GB/s in run order, and the ratio of
each variant's mean and median to those of the first variant (old when there is one).
"""

import glob
import json
import os
import statistics
import sys


def run_number(path: str) -> int:
    tail = os.path.basename(os.path.dirname(path)).rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def main(out: str) -> None:
    cells: dict[tuple, dict[str, list[float]]] = {}
    for f in sorted(glob.glob(out + "/*/bench_*.json"), key=run_number):
        d = json.load(open(f))
        run = os.path.basename(os.path.dirname(f))
        lim = d["limits"]
        print(run, os.path.basename(f),
              f"limits read {lim['storage_read_gbps']:.2f} write {lim['storage_write_gbps']:.2f} GB/s")
        for r in d["results"]:
            print(f"  {r['system']:<12} {r['op']:<8} {r['prefix_tokens'] // 1024:>4}K {r['gbps']:6.2f} GB/s"
                  f" x{r['x_adjacent_limit']:.2f} cpu {r['cpu_us_per_layer']:5.1f} us/layer {r.get('cpu_us_per_call', '')}")
            key = (os.path.basename(f), r["system"], r["op"], r["prefix_tokens"] // 1024)
            cells.setdefault(key, {}).setdefault(run.rsplit("-", 1)[0], []).append(r["gbps"])
    variants = sorted({v for runs in cells.values() for v in runs}, key=lambda v: (v != "old", v))
    if len(variants) < 2:
        return
    base = variants[0]
    print(f"A/B against {base} (ratio of means, of medians):")
    for (file, system, op, k), runs in sorted(cells.items()):
        if base not in runs:
            continue
        line = [f"  {file:<20} {system:<12} {op:<8} {k:>4}K  {base} " + ", ".join(f"{x:.2f}" for x in runs[base])]
        for v in variants[1:]:
            if v in runs:
                mean = statistics.mean(runs[v]) / statistics.mean(runs[base])
                median = statistics.median(runs[v]) / statistics.median(runs[base])
                line.append(f"{v} " + ", ".join(f"{x:.2f}" for x in runs[v]) + f" ({mean:.2f}x, {median:.2f}x)")
        print(" | ".join(line))


if __name__ == "__main__":
    main(sys.argv[1])

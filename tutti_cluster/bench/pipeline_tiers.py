"""The pipeline benchmark's memory-tier runs (``tutti bench --pipeline --memory-paths``): each input
again through a store with a memory tier, ``ideal`` and ``tutti`` with every unit of the prefix in
memory (``tutti-memory-hot``) and with none (``tutti-memory-cold``), and the issue-46 figures that
set them against the first store's ``tutti`` and the HBM ideal. See docs/BENCH.md, "Pipeline"."""

from __future__ import annotations

import statistics
from typing import Any

from tutti_cluster.bench.errors import BenchVerificationError
from tutti_cluster.bench.options import token_label
from tutti_cluster.bench.prefill import harness as hz
from tutti_cluster.bench.progress import Progress


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _demote_all(h: hz.Harness, case: hz.InputCase, seed: int) -> None:
    """Moves the case's units out of the memory tier: as many other units as it has slots are
    stored (the least recently used units with a storage copy lose their memory copy to them),
    flushed, and removed again."""
    import numpy as np

    store = h.store
    slots = int(store.stats()["memory_slots"])
    ub = int(store.unit_blocks)
    ids = case.block_ids[: len(case.keys) * ub].tolist()
    rng = np.random.default_rng(seed ^ 0xDE)
    others: list[int] = []
    while len(others) < slots:
        keys = [int(k) for k in rng.integers(1, 2**63 - 1, size=min(len(case.keys), slots - len(others)))]
        res = store.store(keys, ids[: len(keys) * ub])
        if res.failed_units:
            raise BenchVerificationError(f"demoting the prefix: {len(res.failed_units)} of {len(keys)} units failed")
        others += keys
    store.flush()
    for k in others:
        store.remove(k)


def run_input(plan: Any, h: hz.Harness, n: int, progress: Progress) -> list[dict[str, Any]]:
    """One input through the memory-tier store: the prefix stored (into memory), then per prefix
    ``ideal`` and ``tutti`` with every unit in memory (``tutti-memory-hot``), then the same with
    every unit on storage only (``tutti-memory-cold``)."""
    from tutti_cluster.bench.tutti_system import check_tiers

    prefixes = plan.prefixes[n]
    case = h.new_case(n, max(prefixes))
    rows: list[dict[str, Any]] = []
    s = plan.shape
    try:
        h.prepare(case, compute=False)
        itl = h.itl(case, plan.decode_steps)
        for state, where in (("hot", ("memory", "both")), ("cold", ("storage",))):
            name = f"tutti-memory-{state}"
            if state == "cold":
                _demote_all(h, case, plan.seed)
            check_tiers(h.store, case.keys, where, name)
            for p in sorted(prefixes, reverse=True):
                h.warm_up(case, p)
                ideal, outs = [], []
                for _ in range(plan.repeat):
                    i = h.run("ideal", case, p)
                    o = h.run("tutti", case, p, decode_steps=plan.decode_steps)
                    if not hz.compare(i.out, o.out)["exact"]:
                        raise BenchVerificationError(f"{name} at {n} tokens, prefix {p}: output differs from the "
                                                     "resident run")
                    ideal.append(i.ttft_s)
                    outs.append(o)
                    progress.step(f"{token_label(n)} P={token_label(p)} {name}")
                ideal_s, ttft = _median(ideal), _median([o.ttft_s for o in outs])
                prefix_gb = p * s.kv_bytes_per_token / 1e9
                row: dict[str, Any] = {
                    "input_tokens": n, "prefix_tokens": p, "hit_rate": round(p / n, 5), "system": name,
                    "number": None, "ttft_s": round(ttft, 5), "ttft_runs_s": [round(o.ttft_s, 5) for o in outs],
                    "ideal_s": round(ideal_s, 5), "bubble_s": round(ttft - ideal_s, 5),
                    "x_ideal": round(ttft / ideal_s, 4), "matches_ideal": "bitwise", "rounds": len(outs),
                    "cost_per_1m_tokens": round(hz.cost_per_million(
                        plan.prices, ttft_s=ttft, itl_s=itl, output_tokens=plan.output_tokens,
                        dram_gb=plan.cfg.staging_mb / 1024 + (prefix_gb if state == "hot" else 0.0),
                        ssd_gb=prefix_gb), 4)}
                if plan.decode_steps:
                    row["itl_s"] = round(_median([o.extra["itl_s"] for o in outs]), 6)
                rows.append(row)
            check_tiers(h.store, case.keys, where, f"{name}, after its runs")  # promote_hits 0: nothing moved
        return rows
    finally:
        h.release(case)


def figures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per input and prefix: the memory tier with no unit in memory against the store without one
    (TTFT and ITL, target within 5 %), and with every unit in memory against the HBM ideal of its
    own runs (target at most 1.02x)."""
    by = {(r["input_tokens"], r["prefix_tokens"], r["system"]): r for r in rows}
    out = []
    for (n, p, system), cold in sorted(by.items()):
        off, hot = by.get((n, p, "tutti")), by.get((n, p, "tutti-memory-hot"))
        if system != "tutti-memory-cold" or off is None or hot is None:
            continue
        f: dict[str, Any] = {"input_tokens": n, "prefix_tokens": p, "ttft_off_s": off["ttft_s"],
                             "ttft_cold_s": cold["ttft_s"], "ttft_cold_x_off": round(cold["ttft_s"] / off["ttft_s"], 4),
                             "ttft_hot_s": hot["ttft_s"], "ideal_s": hot["ideal_s"], "ttft_hot_x_ideal": hot["x_ideal"]}
        if "itl_s" in off and "itl_s" in cold:
            f.update(itl_off_s=off["itl_s"], itl_cold_s=cold["itl_s"],
                     itl_cold_x_off=round(cold["itl_s"] / off["itl_s"], 4))
        f["met"] = {"cold_within_5pct": abs(f["ttft_cold_x_off"] - 1) <= 0.05 and
                    abs(f.get("itl_cold_x_off", 1.0) - 1) <= 0.05, "hot_within_ideal_x1.02": hot["x_ideal"] <= 1.02}
        out.append(f)
    return out


def figure_lines(figs: list[dict[str, Any]]) -> list[str]:
    """The table's lines for :func:`figures`, one per input and prefix."""
    lines = []
    for f in figs:
        itl = (f" ITL {f['itl_cold_s'] * 1e3:.2f} against {f['itl_off_s'] * 1e3:.2f} ms ({f['itl_cold_x_off']:.3f}x);"
               if "itl_cold_x_off" in f else "")
        lines.append(f"memory tier {token_label(f['input_tokens'])}/{token_label(f['prefix_tokens'])}: none in memory: "
                     f"TTFT {f['ttft_cold_s']:.4f} against {f['ttft_off_s']:.4f} s with no memory tier "
                     f"({f['ttft_cold_x_off']:.3f}x),{itl} all in memory: TTFT {f['ttft_hot_s']:.4f} against the "
                     f"ideal's {f['ideal_s']:.4f} s ({f['ttft_hot_x_ideal']:.3f}x; target <= 1.02)")
    return lines

"""PNG plots of the benchmarks' reports: `tutti bench` (bandwidth against prefix length), the pipeline, the tiers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_COLORS = {"tutti": "C2", "tutti-mapped": "C4", "per-block": "C0", "per-chunk": "C1", "kvikio": "C3"}
_LIMIT_LINES = {
    "retrieve": (("storage_read_gbps", "storage read limit"), ("h2d_gbps", "host-to-GPU limit")),
    "store": (("storage_write_gbps", "storage write limit"),),
}


def subplots(rows: int, cols: int, figsize: tuple[float, float]) -> Any:
    """A figure of rows x cols panels (always a 2-D array of axes), drawn off screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=figsize, squeeze=False)


def save_figure(fig: Any, path: Path, title: str) -> None:
    """Writes ``fig`` as a PNG at ``path``, under ``title`` when one is given, and closes it."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(report: Mapping[str, Any], path: Path, title: str = "") -> None:
    """Write ``report`` (the benchmark's JSON object) as a PNG at ``path``."""
    results: Sequence[Mapping[str, Any]] = report["results"]
    limits: Mapping[str, float] = report["limits"]
    ops = [op for op in ("retrieve", "store") if any(r["op"] == op for r in results)]
    fig, axes = subplots(1, max(1, len(ops)), figsize=(6.5 * max(1, len(ops)), 4.5))
    for ax, op in zip(axes[0], ops):
        systems = sorted({r["system"] for r in results if r["op"] == op}, key=lambda s: (s != "tutti", s))
        top = 0.0
        for system in systems:
            pts = sorted((r["prefix_tokens"], r["gbps"]) for r in results if r["op"] == op and r["system"] == system)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system, color=_COLORS.get(system))
            top = max([top] + [p[1] for p in pts])
        for i, (key, label) in enumerate(_LIMIT_LINES[op]):
            if key in limits:
                ax.axhline(limits[key], linestyle="--", color=f"C{7 + i}", label=f"{label} ({limits[key]:.1f} GB/s)")
                top = max(top, limits[key])
        # The limit passes measured beside tutti's own passes (median over its rounds).
        beside = sorted((r["prefix_tokens"], r["adjacent_limit_gbps"]) for r in results
                        if r["op"] == op and r["system"] == "tutti" and r.get("adjacent_limit_gbps"))
        if beside:
            ax.plot([p[0] for p in beside], [p[1] for p in beside], linestyle=":", marker="x", color="C7",
                    label="storage limit beside tutti's passes")
            top = max([top] + [p[1] for p in beside])
        ax.set_xscale("log", base=2)
        xs = sorted({r["prefix_tokens"] for r in results})
        ax.set_xticks(xs, [f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in xs])
        ax.set_xlabel("prefix length (tokens)")
        ax.set_ylabel("GB/s")
        ax.set_ylim(0, top * 1.12 or 1.0)
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    save_figure(fig, path, title)


_PIPELINE_COLORS = {"ideal": "k", "tutti": "C2", "tutti-writeback": "C4", "naive": "C0", "load-all": "C1",
                    "per-chunk": "C3", "recompute": "C7"}


def plot_pipeline(report: Mapping[str, Any], path: Path, title: str = "") -> None:
    """``tutti bench --pipeline``'s report as a PNG: per input, TTFT against prefix length per system
    (recompute dashed), and the latency breakdown against hit rate (compute, bubble, load phase)."""
    results: Sequence[Mapping[str, Any]] = report["results"]
    inputs = sorted({r["input_tokens"] for r in results})
    fig, axes = subplots(len(inputs), 2, figsize=(13, 4.5 * len(inputs)))
    for (ax, bx), n in zip(axes, inputs):
        rows = [r for r in results if r["input_tokens"] == n]
        systems = [s for s in _PIPELINE_COLORS if any(r["system"] == s and r["prefix_tokens"] for r in rows)]
        for s in systems:
            pts = sorted((r["prefix_tokens"], r["ttft_s"]) for r in rows if r["system"] == s and r["prefix_tokens"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s, color=_PIPELINE_COLORS[s])
        for r in rows:
            if r["system"] == "recompute":
                ax.axhline(r["ttft_s"], linestyle="--", color=_PIPELINE_COLORS["recompute"],
                           label=f"recompute ({r['ttft_s']:.2f} s)")
        xs = sorted({r["prefix_tokens"] for r in rows if r["prefix_tokens"]})
        ax.set_xticks(xs, [f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in xs], rotation=30)
        ax.set_xlabel("prefix length (tokens)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"input {n // 1024}K tokens" if n % 1024 == 0 else f"input {n} tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        # Breakdown: per hit rate, tutti's compute (the ideal) and bubble; load-all's load and compute.
        hits = sorted({r["hit_rate"] for r in rows if r["prefix_tokens"]})
        pos = range(len(hits))
        ideal = {r["hit_rate"]: r["ttft_s"] for r in rows if r["system"] == "ideal"}
        width = 0.38
        for k, (s, shift) in enumerate((("tutti", -width / 2), ("load-all", width / 2))):
            by = {r["hit_rate"]: r for r in rows if r["system"] == s}
            if not by:
                continue
            comp = [ideal.get(h, 0.0) for h in hits]
            if s == "load-all":
                load = [by[h].get("load_s", 0.0) if h in by else 0.0 for h in hits]
                rest = [max(0.0, by[h]["ttft_s"] - l) if h in by else 0.0 for h, l in zip(hits, load)]
                bx.bar([p + shift for p in pos], load, width, color="C1", label="load-all: load")
                bx.bar([p + shift for p in pos], rest, width, bottom=load, color="C1", alpha=0.45,
                       label="load-all: compute")
            else:
                bubble = [max(0.0, by[h]["ttft_s"] - c) if h in by else 0.0 for h, c in zip(hits, comp)]
                bx.bar([p + shift for p in pos], comp, width, color="C2", alpha=0.45, label="tutti: compute (ideal)")
                bx.bar([p + shift for p in pos], bubble, width, bottom=comp, color="C3", label="tutti: bubble")
        bx.set_xticks(list(pos), [f"{h * 100:.1f}%" for h in hits], rotation=30)
        bx.set_xlabel("hit rate (prefix / input)")
        bx.set_ylabel("seconds")
        bx.set_title("latency breakdown")
        bx.grid(True, axis="y", alpha=0.3)
        bx.legend(fontsize="small")
    save_figure(fig, path, title)


def plot_tiers(report: Mapping[str, Any], path: Path, title: str = "") -> None:
    """``tutti bench tiers``' report as a PNG: restore time per system (mean, p50, p99) and hit rate
    per tier (stacked)."""
    rows = report["results"]
    names = [r["system"] for r in rows]
    fig, axes = subplots(1, 2, figsize=(12, 4.5))
    ax, bx = axes[0]
    width = 0.25
    for k, (stat, color) in enumerate((("mean", "C2"), ("p50", "C0"), ("p99", "C3"))):
        ax.bar([i + (k - 1) * width for i in range(len(rows))], [r["restore_s"][stat] * 1e3 for r in rows], width,
               label=stat, color=color)
    ax.set_xticks(range(len(rows)), names)
    ax.set_ylabel("restore time per request (ms)")
    ax.set_title("restore time")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    bottom = [0.0] * len(rows)
    for tier, color in (("memory", "C4"), ("storage", "C1"), ("miss", "C7")):
        vals = [r["hit_rate"][tier] * 100 for r in rows]
        bx.bar(range(len(rows)), vals, 0.5, bottom=bottom, label=tier if tier == "miss" else f"{tier} hits",
               color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    bx.set_xticks(range(len(rows)), names)
    bx.set_ylabel("% of units looked up")
    bx.set_ylim(0, 100)
    bx.set_title("hits per tier")
    bx.grid(True, axis="y", alpha=0.3)
    bx.legend(fontsize="small")
    save_figure(fig, path, title)

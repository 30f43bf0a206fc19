"""PNG plot of a benchmark report: bandwidth against prefix length, one panel per operation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_COLORS = {"tutti": "C2", "tutti-mapped": "C4", "per-block": "C0", "per-chunk": "C1", "kvikio": "C3"}
_LIMIT_LINES = {
    "retrieve": (("storage_read_gbps", "storage read limit"), ("h2d_gbps", "host-to-GPU limit")),
    "store": (("storage_write_gbps", "storage write limit"),),
}


def plot(report: Mapping[str, Any], path: Path, title: str = "") -> None:
    """Write ``report`` (the benchmark's JSON object) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: Sequence[Mapping[str, Any]] = report["results"]
    limits: Mapping[str, float] = report["limits"]
    ops = [op for op in ("retrieve", "store") if any(r["op"] == op for r in results)]
    fig, axes = plt.subplots(1, max(1, len(ops)), figsize=(6.5 * max(1, len(ops)), 4.5), squeeze=False)
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
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

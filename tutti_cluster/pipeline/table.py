"""The slack windows' table the scheduler reads: an offline profile file (written by ``tutti
profile``, :mod:`tutti_cluster.bench.prefill.profile`), per (input length, prefix length) point on
a 32-token grid and per layer, the window's duration (the layer's compute time, during which the
I/O partition is free) and the free SM budget. The file is keyed by the model shape, the GPU and
the SM split; :class:`SlackTable` refuses a file made for another key and interpolates between grid
points (linearly in the prefix, then in the input).

Torch is imported only when a profile loads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tutti_cluster.errors import ConfigError

ALIGN = 32  # tokens: the grid's step (one warp's worth of tokens, as the paper's table)
FORMAT = 1


def profile_key(model_key: str, gpu: str, io_sms: int) -> dict[str, Any]:
    return {"model": model_key, "gpu": gpu, "io_sms": io_sms}


def device_name(device: Any) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class SlackTable:
    """A profile file's windows: ``windows(n, p)`` -> per-layer seconds for input ``n``, prefix ``p``."""

    def __init__(self, data: dict[str, Any]) -> None:
        if data.get("format") != FORMAT:
            raise ConfigError(f"profile format {data.get('format')!r}; this version reads format {FORMAT}")
        self.key = data["key"]
        self.layers = int(data["layers"])
        self.sms = data.get("sms")
        by: dict[int, list[tuple[int, list[float]]]] = {}
        for g in data["grid"]:
            if len(g["layer_ms"]) != self.layers:
                raise ConfigError(f"profile point {g['input']}/{g['prefix']}: {len(g['layer_ms'])} layers, "
                                  f"expected {self.layers}")
            by.setdefault(int(g["input"]), []).append((int(g["prefix"]), [x / 1e3 for x in g["layer_ms"]]))
        if not by:
            raise ConfigError("the profile has no grid points")
        self._by = {n: sorted(pts) for n, pts in sorted(by.items())}

    @classmethod
    def load(cls, path: Path, shape: Any, device: Any, io_sms: int) -> "SlackTable":
        """Reads ``path`` and checks that it was made for this model shape, GPU and SM split."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the profile {path}: {e}") from None
        t = cls(data)
        want = profile_key(shape.key(), device_name(device), io_sms if device.type == "cuda" else 0)
        if t.key != want:
            raise ConfigError(f"profile {path} was made for {t.key}, this run is {want}: run `tutti profile` here")
        return t

    @staticmethod
    def _lerp(pts: Sequence[tuple[int, list[float]]], x: float) -> list[float]:
        if x <= pts[0][0]:
            return list(pts[0][1])
        if x >= pts[-1][0]:
            return list(pts[-1][1])
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x0 <= x <= x1:
                f = (x - x0) / (x1 - x0) if x1 > x0 else 0.0
                return [a + (b - a) * f for a, b in zip(y0, y1)]
        return list(pts[-1][1])

    def windows(self, n: int, prefix: int) -> list[float]:
        """Per-layer windows (seconds), the query rounded to the 32-token grid, then interpolated."""
        n, prefix = round(n / ALIGN) * ALIGN, round(prefix / ALIGN) * ALIGN
        inputs = list(self._by)
        rows = [(m, self._lerp(self._by[m], prefix * m / n if n else 0)) for m in inputs]
        if len(rows) == 1:
            return rows[0][1]
        # Across inputs the prefix is taken at the same hit rate, then interpolated in the input.
        return self._lerp(rows, n)

"""What ``tutti bench``, ``tutti bench --pipeline`` and ``tutti profile`` parse and resolve alike:
token counts, comma lists, prefix specs, the device, and the work directories of killed runs.

PyTorch is imported only by :func:`resolve_device`."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tutti_cluster.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_INPUTS = ("64K", "128K")  # --pipeline's and the profile's input lengths on a GPU
CPU_INPUTS = ("1K", "2K")  # ... and on the CPU


def token_label(tokens: int) -> str:
    """``16384`` -> ``"16K"``, ``512`` -> ``"512"``: the inverse of :func:`parse_tokens`."""
    return f"{tokens // 1024}K" if tokens and tokens % 1024 == 0 else str(tokens)


def parse_tokens(text: str) -> int:
    """``"16K"`` -> 16384, ``"512"`` -> 512."""
    t = text.strip().upper()
    try:
        if t.endswith("K"):
            return int(t[:-1]) << 10
        if t.endswith("M"):
            return int(t[:-1]) << 20
        return int(t)
    except ValueError:
        raise ConfigError(f"not a token count: {text!r} (use e.g. 16K or 16384)") from None


def split_list(values: Sequence[str] | None) -> list[str]:
    """A list flag's values, each of which may itself be a comma list: ``["a,b", "c"]`` -> a, b, c."""
    return [v for item in values or () for v in item.split(",") if v.strip()]


def prefix_for(spec: str, n: int, unit: int) -> int:
    """A prefix spec for an input of ``n`` tokens: tokens (``16K``), a share (``75%``) rounded down
    to whole units, or ``-1u`` (the input minus one unit)."""
    t = spec.strip().lower()
    if t in ("-1u", "input-1u", "input-minus-one-unit"):
        return n - unit
    if t.endswith("%"):
        try:
            share = float(t[:-1])
        except ValueError:
            raise ConfigError(f"not a prefix share: {spec!r} (use e.g. 75%)") from None
        if not 0 < share < 100:
            raise ConfigError(f"prefix share {spec!r} must lie strictly between 0% and 100%")
        return int(n * share / 100) // unit * unit
    return parse_tokens(spec)


def resolve_device(name: str) -> torch.device:
    """``--device cpu|cuda|auto``: auto is the current CUDA device when torch sees one, else the CPU."""
    import torch

    if name == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cuda":
        raise DeviceError("--device cuda: no CUDA device is available to torch")
    return torch.device("cpu")


RUN_PREFIX = "tutti-bench-"  # a run's directory in each path: tutti-bench-<pid>


def remove_stale_runs(dirs: Sequence[Path]) -> None:
    """Remove ``tutti-bench-<pid>`` directories left by runs whose process is gone (killed)."""
    for d in dirs:
        for w in d.glob(f"{RUN_PREFIX}*"):
            pid = w.name.removeprefix(RUN_PREFIX)
            if w.is_dir() and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                logger.info("removing %s, left by an earlier run", w)
                shutil.rmtree(w, ignore_errors=True)


def run_dirs(dirs: Sequence[Path]) -> list[Path]:
    """This run's directory in each of ``dirs`` (not made yet), once those of runs that are gone
    are removed (:func:`remove_stale_runs`)."""
    remove_stale_runs(dirs)
    return [d / f"{RUN_PREFIX}{os.getpid()}" for d in dirs]

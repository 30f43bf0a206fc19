"""Description of the machine and storage a benchmark ran on (the JSON's ``machine`` object)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tutti_cluster.bench import fsutil


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field (e.g. "MemTotal", "MemAvailable") in bytes; 0 if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == field:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def describe(paths: Sequence[Path], direct_io: dict[Path, bool], device: torch.device) -> dict[str, Any]:
    """Hostname, CPU, cores, memory, kernel, GPU, the storage paths with their file systems, date."""
    out: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "mem_bytes": meminfo_bytes("MemTotal"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device.type,
        "paths": [
            {"path": str(p), "fs_type": fsutil.fs_type(p), "direct_io": direct_io.get(p, False)} for p in paths
        ],
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["gpu_mem_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return out

"""What the connector tells the operator: its start-up line, bounded warnings, the store's causes.

- :func:`banner`: the one INFO line each worker logs once its store is open (version, backend,
  paths and capacity, unit and block size, units found, node daemon, cluster).
- :class:`BoundedLog`: warnings of one kind (failed loads, failed saves) at most ``per_minute`` a
  minute; past that they are counted, and the count is logged with the next warning let through
  (or at shutdown), so that a damaged disk cannot flood the log.
- :func:`describe_failures`: a request's failed units as the store reports them (each one's key,
  pool file and slot, and cause).
- :func:`describe_pools`: a store instance's paths, capacity and pool files, per tier.
- :class:`Reminder`: a warning repeated every minute from a daemon thread, until stopped (an engine
  serving without its cache says so until it restarts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tutti_cluster.config import TuttiConfig
from tutti_cluster.store import pool_files
from tutti_cluster.store import UnitFailure

__all__ = ["BoundedLog", "Reminder", "banner", "describe_failures", "describe_pools", "pool_files"]


class BoundedLog:
    """At most ``per_minute`` warnings a minute through ``logger``; the rest are counted and the
    count is logged with the next warning let through, or by :meth:`flush`."""

    def __init__(self, logger: logging.Logger, per_minute: int = 10, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.per_minute = per_minute
        self.window_s = window_s
        self.clock = clock
        self._start = clock()
        self._count = 0
        self.suppressed = 0  # in the current window
        self.suppressed_total = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: Any) -> bool:
        """Logs ``msg % args`` unless this window's quota is spent; returns whether it was logged."""
        with self._lock:
            now = self.clock()
            if now - self._start >= self.window_s:
                self._report_suppressed(now)
                self._start, self._count = now, 0
            if self._count >= self.per_minute:
                self.suppressed += 1
                self.suppressed_total += 1
                return False
            self._count += 1
        self.logger.warning(msg, *args, stacklevel=2)  # the caller's line, not this one
        return True

    def _report_suppressed(self, now: float) -> None:
        if self.suppressed:
            n = self.suppressed
            self.logger.warning("Tutti: %d more warning%s like the above in %.0f s %s not logged (at most %d a "
                                "minute are)", n, "" if n == 1 else "s", now - self._start,
                                "was" if n == 1 else "were", self.per_minute)
            self.suppressed = 0

    def flush(self) -> None:
        """Logs the count of warnings held back in the current window, if any."""
        with self._lock:
            self._report_suppressed(self.clock())


class Reminder:
    """Logs ``message`` as a warning every ``every_s`` seconds from a daemon thread until :meth:`stop`."""

    def __init__(self, logger: logging.Logger, message: str, every_s: float = 60.0) -> None:
        self.logger = logger
        self.message = message
        self.every_s = every_s
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tutti-no-cache-reminder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.count += 1
            self.logger.warning("%s", self.message)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


def describe_pools(config: TuttiConfig) -> str:
    """``/mnt/a (4 GiB in 1 pool file), ...``: each path, its capacity and how many pool files hold it;
    then the memory tier's paths the same way, and the write policy, where there is one."""
    text = _describe_paths(config, config.storage_paths(), config.capacity_bytes())
    if config.memory_paths:
        memory = _describe_paths(config, config.memory_paths, config.memory_capacity_bytes())
        text += f"; memory tier {memory}, {config.write_policy}"
    return text


def _describe_paths(config: TuttiConfig, paths: Sequence[Path], caps: Sequence[int]) -> str:
    files = pool_files(config.model_copy(update={"paths": list(paths)}))  # the same names on any path
    parts = []
    for p, cap in zip(paths, caps):
        n = sum(1 for f in files if f.parent == Path(p))
        parts.append(f"{p} ({cap / (1 << 30):.3g} GiB in {n} pool file{'s' if n != 1 else ''})")
    return ", ".join(parts)


def banner(*, version: str, rank: int, instance: str, backend: str, pools: str, unit_tokens: int, block_size: int,
           units: int, layers: int, daemon: str, cluster: str, direct_io: bool) -> str:
    """The connector's start-up line (one per worker rank)."""
    blocks = unit_tokens // block_size
    return (f"Tutti connector {version} rank {rank}: instance {instance}, backend {backend}, "
            f"{'O_DIRECT' if direct_io else 'buffered I/O'}; store {pools}; unit {unit_tokens} tokens = {blocks} "
            f"block{'s' if blocks != 1 else ''} of {block_size}, {layers} layers; {units} units found in the pool; "
            f"{daemon}; {cluster}")


def describe_failures(failures: Sequence[UnitFailure], at_most: int = 3) -> str:
    """The first ``at_most`` failed units in full (index, key, pool file, slot and byte offset,
    cause), then how many more failed, by cause."""
    text = "; ".join(f.describe() for f in failures[:at_most])
    rest = Counter(f.cause for f in failures[at_most:])
    if rest:
        n = sum(rest.values())
        text += f"; {n} more unit{'s' if n != 1 else ''} ({', '.join(f'{k}: {v}' for k, v in rest.items())})"
    return text

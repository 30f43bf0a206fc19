"""The connector's counters: :class:`TuttiConnectorStats` per interval, :class:`TuttiPromMetrics`.

Each role counts what it does in its own :class:`TuttiConnectorStats` (the scheduler: units found,
those found inside another prompt's unit, saves deferred, and reads of a failed load's blocks; each worker: units loaded, stored, skipped, failed, fetched from other nodes, I/Os straight between files and KV blocks, and the microseconds the
forward waited for a layer's load).
vLLM collects them with ``get_kv_connector_stats``, sums the workers' and the scheduler's with
``aggregate``, logs them in its "KV Transfer metrics" line and hands them to
:class:`TuttiPromMetrics`, one Prometheus counter ``vllm:tutti_<stat>`` per stat (units, blocks, I/Os or microseconds, as named).

The workers also pass on their stores' per-tier counters (:data:`STORE_COUNTERS`: hits per tier,
promotions, demotions, flushes; zero without a memory tier) as they moved since the last report, and
the memory tier's size and flush backlog (:data:`STORE_GAUGES`) as how much they changed: summed over
workers and reports that is the current value, which ``vllm:tutti_<stat>`` gauges hold (the log line
leaves them out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["STAT_KEYS", "STORE_COUNTERS", "STORE_GAUGES", "TuttiConnectorStats", "TuttiPromMetrics"]

#: The store's counters (``TuttiStore.stats()``) each worker reports as they moved since its last report.
STORE_COUNTERS = ("direct_ios", "memory_hits", "storage_hits", "promotions", "demotions", "flushes", "flush_bytes",
                  "flush_errors")
#: The store's gauges, each reported as how much it changed since the worker's last report.
STORE_GAUGES = ("memory_units", "memory_slots", "flush_backlog")

STAT_KEYS = (
    "lookup_hit_units",
    "lookup_shared_units",
    "load_units",
    "load_failed_units",
    "store_units",
    "store_skipped_units",
    "store_failed_units",
    "store_deferred_units",
    "remote_units",
    "poisoned_block_reads",
    "load_wait_us",
    *STORE_COUNTERS,
    *STORE_GAUGES,
)


@dataclass
class TuttiConnectorStats(KVConnectorStats):
    """Unit counters of one interval, summed over workers and the scheduler."""

    def __post_init__(self) -> None:
        for k in STAT_KEYS:
            self.data.setdefault(k, 0)

    def add(self, name: str, n: int) -> None:
        self.data[name] = self.data.get(name, 0) + int(n)

    def reset(self) -> None:
        self.data = {k: 0 for k in STAT_KEYS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + int(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        # The gauges' changes say nothing alone: the Prometheus gauges hold their values.
        return {k: int(v) for k, v in self.data.items() if k not in STORE_GAUGES}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> TuttiConnectorStats | None:
        """Returns the counts so far (None if all zero) and starts a new interval."""
        if self.is_empty():
            return None
        out = TuttiConnectorStats(data=dict(self.data))
        self.reset()
        return out


class TuttiPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per stat: ``vllm:tutti_<stat>_total`` (units, blocks, I/Os, bytes or
    microseconds, as named; summed over worker ranks), and a gauge ``vllm:tutti_<stat>`` for each of
    :data:`STORE_GAUGES`."""

    _DOC = {
        "lookup_hit_units": "Cache units the scheduler found in the Tutti store and scheduled to load.",
        "lookup_shared_units": "Of those, units another prompt stored, of which a prompt that shares only their "
                               "leading blocks loads those blocks.",
        "load_units": "Cache units the Tutti store loaded into KV blocks.",
        "load_failed_units": "Cache units whose load failed (missing or corrupt) and were recomputed.",
        "store_units": "Cache units committed to the Tutti store.",
        "store_skipped_units": "Cache units not stored because the store already held them.",
        "store_failed_units": "Cache units whose store failed (capacity or I/O).",
        "store_deferred_units": "Cache units whose save waited until a step that loaded KV was known good.",
        "remote_units": "Cache units fetched from other nodes' stores (cluster mode).",
        "poisoned_block_reads": "KV blocks (not units) of a failed load, still in vLLM's prefix cache, that a "
                                "request read; reported as failed loads and recomputed.",
        "direct_ios": "Storage I/Os (not units) of loads and saves that moved KV straight between a pool file "
                      "and vLLM's KV blocks, with no staging copy (O_DIRECT needs a page-aligned KV cache: "
                      "THP_MEM_ALLOC_ENABLE=1 on the CPU build).",
        "load_wait_us": "Microseconds (not units) the forward waited in wait_for_layer_load for loads still "
                        "in flight: the part of a restore that compute did not hide (zero when every layer "
                        "lands before its attention needs it).",
        "memory_hits": "Store lookup hits (units) whose fastest copy was in the memory tier.",
        "storage_hits": "Store lookup hits (units) whose only copy was in the storage tier.",
        "promotions": "Units copied from the storage tier into the memory tier (read often enough).",
        "demotions": "Memory-tier copies dropped to make room, their storage copy kept (units).",
        "flushes": "Units copied from the memory tier to the storage tier (durable from then on).",
        "flush_bytes": "Bytes (not units) copied from the memory tier to the storage tier.",
        "flush_errors": "Copies from the memory tier to the storage tier that failed (units).",
        "memory_units": "Units with a copy in the memory tier, over the worker ranks.",
        "memory_slots": "Slots of the memory tier, over the worker ranks.",
        "flush_backlog": "Units in the memory tier only, waiting for their storage copy (not durable yet).",
    }

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        for name in STAT_KEYS:
            cls = self._gauge_cls if name in STORE_GAUGES else self._counter_cls
            metric = cls(name=f"vllm:tutti_{name}", documentation=self._DOC[name], labelnames=labelnames)
            for idx, values in per_engine_labelvalues.items():
                self._counters[(idx, name)] = metric.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, v in transfer_stats_data.items():
            c = self._counters.get((engine_idx, name))
            if c is not None and v:
                c.inc(v)  # a gauge's change may be negative

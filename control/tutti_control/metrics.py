"""Prometheus metrics of the cache, collected at scrape time through prometheus-client.

One :class:`TuttiCollector` per app asks its backend for a snapshot (the node daemon's stats, or
every node's in the cluster-wide admin) when ``/metrics`` is scraped, and yields metric families:
nothing is kept between scrapes, and no exposition text is written by hand.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# (field of Counters, metric name, help, counter?)
PER_INSTANCE = [
    ("units", "tutti_units", "Units held (from the pool headers)", False),
    ("used_bytes", "tutti_used_bytes", "Bytes of slots holding a unit", False),
    ("capacity_bytes", "tutti_instance_capacity_bytes", "Capacity share granted to the instance", False),
    ("pinned", "tutti_pinned_units", "Units pinned in the engine's store", False),
    ("hits", "tutti_hits", "Units found by engine lookups", True),
    ("misses", "tutti_misses", "Units asked for by engine lookups and not found", True),
    ("bytes_read", "tutti_read_bytes", "Bytes retrieved from storage by the engine", True),
    ("bytes_written", "tutti_written_bytes", "Bytes stored by the engine", True),
    ("read_bytes_per_s", "tutti_read_bandwidth_bytes_per_second", "Retrieve bandwidth over the last report interval", False),
    ("write_bytes_per_s", "tutti_write_bandwidth_bytes_per_second", "Store bandwidth over the last report interval", False),
    ("evictions", "tutti_evictions", "Units evicted by the engine's store", True),
    ("checksum_failures", "tutti_checksum_failures", "Objects that failed their checksum", True),
    ("io_errors", "tutti_io_errors", "Storage I/O errors", True),
    ("remote_units", "tutti_remote_fetch_units", "Units the engine fetched from other nodes", True),
    ("remote_bytes", "tutti_remote_fetch_bytes", "Bytes the engine fetched from other nodes", True),
    ("remote_failures", "tutti_remote_fetch_failures", "Remote fetches that ended early", True),
    # The memory tier (zero without one).
    ("memory_capacity_bytes", "tutti_instance_memory_capacity_bytes", "Memory-tier capacity share granted to the "
     "instance", False),
    ("memory_units", "tutti_memory_units", "Units with a copy in the memory tier", False),
    ("memory_slots", "tutti_memory_slots", "Slots of the memory tier", False),
    ("memory_free_slots", "tutti_memory_free_slots", "Free slots of the memory tier", False),
    ("memory_bytes_read", "tutti_memory_read_bytes", "Bytes retrieved from the memory tier by the engine", True),
    ("promotions", "tutti_promotions", "Units copied from the storage tier into the memory tier", True),
    ("demotions", "tutti_demotions", "Memory-tier copies dropped to make room, their storage copy kept", True),
    ("flushes", "tutti_flushes", "Units copied from the memory tier to the storage tier", True),
    ("flush_bytes", "tutti_flush_bytes", "Bytes copied from the memory tier to the storage tier", True),
    ("flush_errors", "tutti_flush_errors", "Copies from the memory tier to the storage tier that failed", True),
    ("flush_backlog", "tutti_flush_backlog_units", "Units in the memory tier only, waiting for their storage copy "
     "(not durable until then)", False),
]
# Store lookup hits by the tier of the unit's fastest copy: (field of Counters, tier label).
TIER_HITS = [("memory_hits", "memory"), ("storage_hits", "storage")]
PER_NODE = [
    ("units", "tutti_node_units", "Distinct units held on the node", False),
    ("stage_units", "tutti_remote_served_units", "Units this node served to other nodes", True),
    ("stage_bytes", "tutti_remote_served_bytes", "Bytes this node served to other nodes", True),
    ("stage_failures", "tutti_remote_served_failures", "Remote reads this node could not serve", True),
    ("directory_errors", "tutti_directory_errors", "Cluster directory (etcd) errors", True),
]


class TuttiCollector(Collector):
    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only (the backend may be away at registration)

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("tutti_node_up", "1 when the node (its daemon) answered this scrape", labels=["node"])
        try:
            nodes, stats = self.backend.snapshot()
        except Exception as exc:  # a scrape must still answer: tutti_node_up says what is wrong
            log.debug("metrics snapshot failed: %s", exc)
            up.add_metric([getattr(self.backend, "name", "local")], 0)
            yield up
            return
        by_id = {s.node_id: s for s in stats.nodes}
        inst_fams = {f: (CounterMetricFamily if c else GaugeMetricFamily)(m, h, labels=["node", "instance"])
                     for f, m, h, c in PER_INSTANCE}
        node_fams = {f: (CounterMetricFamily if c else GaugeMetricFamily)(m, h, labels=["node"])
                     for f, m, h, c in PER_NODE}
        cap = GaugeMetricFamily("tutti_path_capacity_bytes", "Byte cap of a storage path", labels=["node", "path"])
        alloc = GaugeMetricFamily("tutti_path_allocated_bytes", "Capacity of a path granted to instances",
                                  labels=["node", "path"])
        used = GaugeMetricFamily("tutti_path_used_bytes",
                                 "Estimated: used bytes over the paths evenly (units are placed round-robin over them)",
                                 labels=["node", "path"])
        tier_hits = CounterMetricFamily("tutti_tier_hits", "Store lookup hits by the tier of the unit's fastest copy",
                                        labels=["node", "instance", "tier"])
        mem_cap = GaugeMetricFamily("tutti_memory_path_capacity_bytes", "Byte cap of a memory-tier path",
                                    labels=["node", "path"])
        mem_alloc = GaugeMetricFamily("tutti_memory_path_allocated_bytes", "Capacity of a memory-tier path granted to "
                                      "instances", labels=["node", "path"])
        queue = GaugeMetricFamily("tutti_queue_depth", "Items waiting in a queue", labels=["node", "instance", "queue"])
        draining = GaugeMetricFamily("tutti_draining", "1 while the node drains", labels=["node"])
        for n in nodes.nodes:
            up.add_metric([n.node_id], 1 if n.reachable else 0)
            if not n.reachable:
                continue
            draining.add_metric([n.node_id], 1 if n.drain is not None and n.drain.state != "serving" else 0)
            for i, p in enumerate(n.paths):
                c = n.capacity_bytes[i] if i < len(n.capacity_bytes) else 0
                cap.add_metric([n.node_id, p], c)
                alloc.add_metric([n.node_id, p], sum(x.capacity_bytes[i] for x in n.instances if i < len(x.capacity_bytes)))
                used.add_metric([n.node_id, p], n.used_bytes / len(n.paths))
            for i, p in enumerate(n.memory_paths):
                mem_cap.add_metric([n.node_id, p], n.memory_capacity_bytes[i] if i < len(n.memory_capacity_bytes) else 0)
                mem_alloc.add_metric([n.node_id, p], sum(x.memory_capacity_bytes[i] for x in n.instances
                                                         if i < len(x.memory_capacity_bytes)))
            s = by_id.get(n.node_id)
            if s is None:
                continue
            for f, *_ in PER_NODE:
                node_fams[f].add_metric([n.node_id], getattr(s, f))
            for name, c in s.instances.items():
                for f, *_ in PER_INSTANCE:
                    inst_fams[f].add_metric([n.node_id, name], getattr(c, f))
                for f, tier in TIER_HITS:
                    tier_hits.add_metric([n.node_id, name, tier], getattr(c, f))
                queue.add_metric([n.node_id, name, "notifications"], c.notification_queue)
                queue.add_metric([n.node_id, name, "admin_commands"], c.command_queue)
        yield up
        yield draining
        yield cap
        yield alloc
        yield used
        yield mem_cap
        yield mem_alloc
        yield queue
        yield from node_fams.values()
        yield from inst_fams.values()
        yield tier_hits

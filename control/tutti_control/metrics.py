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
]
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
            s = by_id.get(n.node_id)
            if s is None:
                continue
            for f, *_ in PER_NODE:
                node_fams[f].add_metric([n.node_id], getattr(s, f))
            for name, c in s.instances.items():
                for f, *_ in PER_INSTANCE:
                    inst_fams[f].add_metric([n.node_id, name], getattr(c, f))
                queue.add_metric([n.node_id, name, "notifications"], c.notification_queue)
                queue.add_metric([n.node_id, name, "admin_commands"], c.command_queue)
        yield up
        yield draining
        yield cap
        yield alloc
        yield used
        yield queue
        yield from node_fams.values()
        yield from inst_fams.values()

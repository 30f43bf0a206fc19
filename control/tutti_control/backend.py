"""What the admin routes ask: one node through its daemon's socket, or every node of a cluster.

:class:`NodeBackend` speaks the node daemon's JSON-lines protocol over ``<data_dir>/tutti.sock``
(through :class:`tutti_cluster.node.link.DaemonLink`, a few connections in a pool so that concurrent
admin requests do not queue on one socket). :class:`tutti_control.cluster.ClusterBackend` answers
the same questions for every node found in the cluster directory.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator, Sequence, TypeVar

from tutti_cluster.config import TuttiConfig
from tutti_cluster.errors import ConfigError, TuttiError
from tutti_cluster.node.protocol import (ConfigReply, ConfigRequest, DirectoryCounters, DrainReply, DrainRequest,
                                         DrainState, HealthReply, HealthRequest, InstanceStats, ObjectsReply,
                                         ObjectsRequest, PingReply, PingRequest, PinReply, PinRequest, PinsReply,
                                         PinsRequest, RemoteCounters, RemoveUnitsReply, RemoveUnitsRequest, Reply,
                                         Request, StageCounters, StatsReply, StatsRequest, StoreCounters,
                                         UndrainRequest, UnpinReply, UnpinRequest, make_request)

from tutti_control.errors import ApiError
from tutti_control.models import (
    ConfigResponse, Counters, DrainStatus, EvictResult, InstanceInfo, NodeInfo, NodeList, NodeStats,
    ObjectInfo, ObjectList, PinList, PinResult, PinTier, Readiness, StatsResponse, UnpinResult, key_int, key_text,
)

_P = TypeVar("_P", bound=Reply)
SECRET_WORDS = {"token", "secret", "password", "credential", "credentials", "key"}
REDACTED = "<redacted>"


def redact(cfg: dict[str, Any]) -> dict[str, Any]:
    """A copy of a config dict with every secret's value replaced: a setting whose name has a word
    such as ``token`` or ``secret`` (``admin_token``; not ``unit_tokens``, not the token's file)."""
    out = {}
    for k, v in cfg.items():
        words = k.lower().split("_")
        secret = bool(SECRET_WORDS.intersection(words)) and words[-1] != "file"
        out[k] = REDACTED if secret and v not in (None, "") else v
    return out


class DaemonPool:
    """A few DaemonLink connections to one node daemon, each used by one request at a time."""

    def __init__(self, config: TuttiConfig, size: int = 8, timeout_s: float = 15.0) -> None:
        from tutti_cluster.node.link import DaemonLink

        self.config = config
        self._free: queue.LifoQueue[Any] = queue.LifoQueue()
        self._all = [DaemonLink(config, timeout_s=timeout_s) for _ in range(size)]
        for link in self._all:
            self._free.put(link)

    def request(self, req: Request, reply: type[_P]) -> _P:
        """One daemon request and its reply as ``reply``. OSError (no daemon) becomes 503; daemon
        errors keep their class."""
        link = self._free.get()
        try:
            try:
                raw = link.request(req)
            except OSError:
                # A connection of a daemon that restarted since: once more on a fresh one (every
                # daemon op is idempotent, so a request that did arrive is not applied twice).
                raw = link.request(req)
            return reply.model_validate(raw)
        except TuttiError:
            raise  # the daemon's refusal, with its class (ConfigError is also a ValueError)
        except OSError as exc:
            raise ApiError(503, "daemon_unavailable", f"the node daemon does not answer on {link.path}: {exc}") from exc
        except ValueError as exc:  # a reply that is not JSON, or not the op's reply
            raise ApiError(502, "bad_gateway", f"the node daemon sent a bad reply: {exc}") from exc
        finally:
            self._free.put(link)

    def close(self) -> None:
        for link in self._all:
            link.close()


def daemon_error(exc: TuttiError) -> ApiError:
    """A daemon refusal, as an API error (its message is the daemon's): a request the daemon finds
    invalid is the client's (400), anything else the daemon's (502)."""
    if isinstance(exc, ConfigError):
        return ApiError(400, "bad_request", str(exc))
    return ApiError(502, "daemon_error", str(exc), {"class": type(exc).__name__})


def instance_counters(ent: InstanceStats) -> Counters:
    """Counters of one instance from the daemon's stats: the engine's report where it has one,
    the daemon's read-only view of its pools otherwise."""
    view = ent.view
    eng = ent.engine if ent.engine is not None else StoreCounters()
    occ = ent.occupancy()  # units and slots: the engine's store when it reports, else the view
    slot = occ.slot_bytes or view.slot_bytes
    used_slots = occ.total_slots - occ.free_slots
    lookups, hits = eng.lookups, eng.hits
    remote = ent.cluster if ent.cluster is not None else RemoteCounters()
    return Counters(
        units=occ.units, capacity_bytes=sum(ent.capacity),
        used_bytes=max(0, used_slots) * slot, pinned=eng.pinned, lookups=lookups, hits=hits,
        misses=max(0, lookups - hits), hit_rate=(hits / lookups) if lookups else None,
        bytes_read=eng.bytes_read, bytes_written=eng.bytes_written,
        read_bytes_per_s=ent.rates.read_bytes_per_s, write_bytes_per_s=ent.rates.write_bytes_per_s,
        evictions=eng.evictions, checksum_failures=eng.checksum_failures + view.checksum_failures,
        io_errors=eng.io_errors + view.io_errors,
        remote_units=remote.remote_units, remote_bytes=remote.remote_bytes, remote_failures=remote.remote_failures,
        notification_queue=ent.notification_queue, command_queue=ent.command_queue,
        memory_capacity_bytes=sum(ent.memory_capacity), memory_units=occ.memory_units, memory_slots=occ.memory_slots,
        memory_free_slots=occ.memory_free_slots, flush_backlog=occ.flush_backlog,
        memory_hits=eng.memory_hits, storage_hits=eng.storage_hits, memory_bytes_read=eng.memory_bytes_read,
        promotions=eng.promotions, demotions=eng.demotions, flushes=eng.flushes, flush_bytes=eng.flush_bytes,
        flush_errors=eng.flush_errors,
    )


def sum_counters(parts: Sequence[Counters]) -> Counters:
    tot = Counters()
    for p in parts:
        for name in Counters.model_fields:
            if name == "hit_rate":
                continue
            setattr(tot, name, getattr(tot, name) + getattr(p, name))
    tot.hit_rate = (tot.hits / tot.lookups) if tot.lookups else None
    return tot


def node_stats_from(raw: StatsReply) -> NodeStats:
    inst = {n: instance_counters(e) for n, e in raw.instances.items()}
    tot = sum_counters(list(inst.values()))
    stage = raw.stage if raw.stage is not None else StageCounters()
    directory = raw.directory if raw.directory is not None else DirectoryCounters()
    tot.units = raw.units  # distinct keys on the node (instances may share keys)
    tot.capacity_bytes = sum(raw.capacity)
    tot.memory_capacity_bytes = sum(raw.memory_capacity)
    tot.stage_units = stage.units_staged
    tot.stage_bytes = stage.bytes_staged
    tot.stage_failures = stage.misses + raw.unreadable_units
    tot.directory_errors = directory.lookup_errors + directory.put_errors
    return NodeStats(node_id=raw.node_id, instances=inst, **tot.model_dump())


def drain_from(raw: DrainState | None) -> DrainStatus:
    if raw is None:
        return DrainStatus(state="serving", units_left=0)
    return DrainStatus.model_validate(raw.model_dump())


def node_info_from(raw: StatsReply, admin: str | None = None) -> NodeInfo:
    instances = []
    for name, ent in sorted(raw.instances.items()):
        occ = ent.occupancy()
        c = instance_counters(ent)
        eng = ent.engine if ent.engine is not None else StoreCounters()
        instances.append(InstanceInfo(
            name=name, capacity_bytes=list(ent.capacity), memory_capacity_bytes=list(ent.memory_capacity),
            units=c.units, memory_units=c.memory_units,
            used_bytes=c.used_bytes, total_slots=occ.total_slots, free_slots=occ.free_slots,
            engine_connected=ent.engine_connected, pinned=eng.pinned if ent.engine_connected else None))
    d = drain_from(raw.drain)
    if d.state == "serving":
        d.units_left = raw.units
    return NodeInfo(
        node_id=raw.node_id, mode="cluster" if raw.cluster_mode else "single",
        admin=admin, paths=list(raw.paths), capacity_bytes=list(raw.capacity), memory_paths=list(raw.memory_paths),
        memory_capacity_bytes=list(raw.memory_capacity), units=raw.units,
        used_bytes=sum(i.used_bytes for i in instances), instances=instances, drain=d)


class NodeBackend:
    """The admin plane of one node: every answer comes from its node daemon."""

    cluster = False

    def __init__(self, config: TuttiConfig, pool_size: int = 8) -> None:
        self.config = config
        self.pool = DaemonPool(config, size=pool_size)
        self._node_id: str | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        self.pool.close()

    def ask(self, request: type[Request], reply: type[_P], **fields: Any) -> _P:
        """One daemon op: its request built from ``fields``, its reply read as ``reply``."""
        try:
            return self.pool.request(make_request(request, **fields), reply)
        except TuttiError as exc:
            raise daemon_error(exc) from exc

    @property
    def node_id(self) -> str:
        if self._node_id is None:
            self._node_id = self.ask(PingRequest, PingReply).node_id
        return self._node_id

    def _check_node(self, node_id: str) -> None:
        if node_id != self.node_id:
            raise ApiError(404, "node_not_found", f"no node {node_id!r} here (this is {self.node_id!r})",
                           {"node_id": node_id})

    # -- health -----------------------------------------------------------------------------------
    def readiness(self) -> Readiness:
        reasons: list[str] = []
        checks: dict[str, bool] = {}
        try:
            h = self.pool.request(HealthRequest(), HealthReply)  # in cluster mode the daemon asks etcd
            checks["daemon"] = True
            cluster_mode, etcd = h.cluster_mode, h.etcd
        except (ApiError, TuttiError) as exc:
            checks["daemon"] = False
            reasons.append(f"node daemon: {exc.message if isinstance(exc, ApiError) else exc}")
            cluster_mode, etcd = self.config.cluster_mode, False
        if cluster_mode:
            checks["etcd"] = bool(etcd)
            if not checks["etcd"]:
                reasons.append("etcd: the node's cluster directory does not answer" if checks["daemon"]
                               else "etcd: not known (the node daemon does not answer)")
        return Readiness(ready=not reasons, reasons=reasons, checks=checks)

    # -- reads ------------------------------------------------------------------------------------
    def nodes(self) -> NodeList:
        return NodeList(nodes=[node_info_from(self.ask(StatsRequest, StatsReply))])

    def node(self, node_id: str) -> NodeInfo:
        self._check_node(node_id)
        return node_info_from(self.ask(StatsRequest, StatsReply))

    def stats(self) -> StatsResponse:
        return self._stats_from(self.ask(StatsRequest, StatsReply))

    @staticmethod
    def _stats_from(raw: StatsReply) -> StatsResponse:
        ns = node_stats_from(raw)
        return StatsResponse(totals=Counters(**{k: getattr(ns, k) for k in Counters.model_fields}), nodes=[ns])

    def snapshot(self) -> tuple[NodeList, StatsResponse]:
        """Nodes and stats from one daemon request (a metrics scrape)."""
        raw = self.ask(StatsRequest, StatsReply)
        return NodeList(nodes=[node_info_from(raw)]), self._stats_from(raw)

    def config_view(self) -> ConfigResponse:
        r = self.ask(ConfigRequest, ConfigReply)
        return ConfigResponse(nodes={r.node_id: redact(dict(r.config))})

    def objects(self, keys: list[str] | None, prefix: str | None, limit: int) -> ObjectList:
        if keys:
            r = self.ask(ObjectsRequest, ObjectsReply, keys=[key_int(k) for k in keys], limit=limit)
        else:
            r = self.ask(ObjectsRequest, ObjectsReply, prefix=(prefix or "").lower(), limit=limit)
        me = r.node_id or self.node_id
        out = []
        for o in r.objects:
            nodes = ([me] if o.instances else []) + [n for n in o.remote if n != me]
            out.append(ObjectInfo(key=key_text(o.key), nodes=nodes,
                                  instances={me: list(o.instances)} if o.instances else {}, pinned=o.pinned,
                                  tiers={me: {i: t for i, t in o.tiers.items() if t}} if o.tiers else {}))
        return ObjectList(objects=out, truncated=r.truncated)

    # -- operations -------------------------------------------------------------------------------
    def evict(self, prefix: str | None, node: str | None, everything: bool, keys: list[str] | None = None) -> EvictResult:
        if node is not None:
            self._check_node(node)
        if keys:
            r = self.ask(RemoveUnitsRequest, RemoveUnitsReply, keys=[key_int(k) for k in keys])
        elif prefix is not None:
            r = self.ask(RemoveUnitsRequest, RemoveUnitsReply, prefix=prefix.lower())
        else:
            r = self.ask(RemoveUnitsRequest, RemoveUnitsReply, all=True)
        counts = {"evicted": r.evicted, "pinned_kept": r.pinned_kept, "unreachable": r.unreachable}
        return EvictResult(evicted=r.evicted, pinned_kept=r.pinned_kept, unreachable=r.unreachable,
                           nodes={self.node_id: counts})

    def pin(self, keys: list[str], tier: PinTier = "any") -> PinResult:
        r = self.ask(PinRequest, PinReply, keys=[key_int(k) for k in keys], tier=tier)
        return PinResult(pinned=[key_text(k) for k in r.pinned], absent=[key_text(k) for k in r.absent],
                         unreachable=[key_text(k) for k in r.unreachable],
                         no_memory_tier=[key_text(k) for k in r.no_memory_tier])

    def unpin(self, keys: list[str]) -> UnpinResult:
        r = self.ask(UnpinRequest, UnpinReply, keys=[key_int(k) for k in keys])
        return UnpinResult(unpinned=[key_text(k) for k in r.unpinned], not_pinned=[key_text(k) for k in r.not_pinned],
                           unreachable=[key_text(k) for k in r.unreachable])

    def pins(self) -> PinList:
        r = self.ask(PinsRequest, PinsReply)
        memory = set(r.memory)
        tiers: dict[str, PinTier] = {key_text(k): "memory" if k in memory else "any" for k in r.keys}
        return PinList(pins=sorted(tiers), count=len(tiers), tiers=dict(sorted(tiers.items())))

    def drain(self, node_id: str, mode: str) -> tuple[str, DrainStatus]:
        self._check_node(node_id)
        return self.node_id, drain_from(self.ask(DrainRequest, DrainReply, mode=mode).drain)

    def undrain(self, node_id: str) -> tuple[str, DrainStatus]:
        self._check_node(node_id)
        return self.node_id, drain_from(self.ask(UndrainRequest, DrainReply).drain)

"""What the admin routes ask: one node through its daemon's socket, or every node of a cluster.

:class:`NodeBackend` speaks the node daemon's JSON-lines protocol over ``<data_dir>/tutti.sock``
(through :class:`tutti_cluster.daemon.DaemonLink`, a few connections in a pool so that concurrent
admin requests do not queue on one socket). :class:`tutti_control.cluster.ClusterBackend` answers
the same questions for every node found in the cluster directory.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator, Sequence

from tutti_cluster.config import TuttiConfig
from tutti_cluster.errors import ConfigError, TuttiError

from tutti_control.errors import ApiError
from tutti_control.models import (
    ConfigResponse, Counters, DrainStatus, EvictResult, InstanceInfo, NodeInfo, NodeList, NodeStats,
    ObjectInfo, ObjectList, PinList, PinResult, Readiness, StatsResponse, UnpinResult, key_int, key_text,
)

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
        from tutti_cluster.daemon import DaemonLink

        self.config = config
        self._free: queue.LifoQueue[Any] = queue.LifoQueue()
        self._all = [DaemonLink(config, timeout_s=timeout_s) for _ in range(size)]
        for link in self._all:
            self._free.put(link)

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One daemon request. OSError (no daemon) becomes 503; daemon errors keep their class."""
        link = self._free.get()
        try:
            try:
                return link.request(msg)
            except OSError:
                # A connection of a daemon that restarted since: once more on a fresh one (every
                # daemon op is idempotent, so a request that did arrive is not applied twice).
                return link.request(msg)
        except TuttiError:
            raise  # the daemon's refusal, with its class (ConfigError is also a ValueError)
        except OSError as exc:
            raise ApiError(503, "daemon_unavailable", f"the node daemon does not answer on {link.path}: {exc}") from exc
        except ValueError as exc:  # a reply that is not JSON
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


def _num(d: dict[str, Any] | None, k: str) -> int:
    return int((d or {}).get(k, 0) or 0)


def instance_counters(ent: dict[str, Any]) -> Counters:
    """Counters of one instance from the daemon's stats: the engine's report where it has one,
    the daemon's read-only view of its pools otherwise."""
    view = ent.get("view") or {}
    eng = ent.get("engine") or {}
    # Units and slots: the engine's own store when it reports (current), else the daemon's
    # read-only view of its pool headers (as of the last rescan).
    occ = eng if ent.get("engine_connected") and eng else view
    slot = _num(occ, "slot_bytes") or _num(view, "slot_bytes")
    used_slots = _num(occ, "total_slots") - _num(occ, "free_slots")
    lookups, hits = _num(eng, "lookups"), _num(eng, "hits")
    rates = ent.get("rates") or {}
    remote = ent.get("cluster") or {}
    return Counters(
        units=_num(occ, "units"), capacity_bytes=sum(int(c) for c in ent.get("capacity", [])),
        used_bytes=max(0, used_slots) * slot, pinned=_num(eng, "pinned"), lookups=lookups, hits=hits,
        misses=max(0, lookups - hits), hit_rate=(hits / lookups) if lookups else None,
        bytes_read=_num(eng, "bytes_read"), bytes_written=_num(eng, "bytes_written"),
        read_bytes_per_s=float(rates.get("read_bytes_per_s", 0.0)),
        write_bytes_per_s=float(rates.get("write_bytes_per_s", 0.0)),
        evictions=_num(eng, "evictions"), checksum_failures=_num(eng, "checksum_failures") + _num(view, "checksum_failures"),
        io_errors=_num(eng, "io_errors") + _num(view, "io_errors"),
        remote_units=_num(remote, "remote_units"), remote_bytes=_num(remote, "remote_bytes"),
        remote_failures=_num(remote, "remote_failures"),
        notification_queue=_num(ent, "notification_queue"), command_queue=_num(ent, "command_queue"),
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


def node_stats_from(raw: dict[str, Any]) -> NodeStats:
    inst = {n: instance_counters(e) for n, e in (raw.get("instances") or {}).items()}
    tot = sum_counters(list(inst.values()))
    stage = raw.get("stage") or {}
    directory = raw.get("directory") or {}
    tot.units = int(raw.get("units", tot.units))  # distinct keys on the node (instances may share keys)
    tot.capacity_bytes = sum(int(c) for c in raw.get("capacity", []))
    tot.stage_units = _num(stage, "units_staged")
    tot.stage_bytes = _num(stage, "bytes_staged")
    tot.stage_failures = _num(stage, "misses") + _num(raw, "unreadable_units")
    tot.directory_errors = _num(directory, "lookup_errors") + _num(directory, "put_errors")
    return NodeStats(node_id=str(raw.get("node_id", "")), instances=inst, **tot.model_dump())


def drain_from(raw: dict[str, Any] | None) -> DrainStatus:
    if not raw:
        return DrainStatus(state="serving", units_left=0)
    return DrainStatus(**raw)


def node_info_from(raw: dict[str, Any], admin: str | None = None) -> NodeInfo:
    instances = []
    for name, ent in sorted((raw.get("instances") or {}).items()):
        connected = bool(ent.get("engine_connected", False))
        eng = ent.get("engine") or {}
        occ = eng if connected and eng else (ent.get("view") or {})
        c = instance_counters(ent)
        instances.append(InstanceInfo(
            name=name, capacity_bytes=[int(x) for x in ent.get("capacity", [])], units=c.units,
            used_bytes=c.used_bytes, total_slots=_num(occ, "total_slots"), free_slots=_num(occ, "free_slots"),
            engine_connected=connected, pinned=_num(eng, "pinned") if connected else None))
    d = drain_from(raw.get("drain"))
    if d.state == "serving":
        d.units_left = int(raw.get("units", 0))
    return NodeInfo(
        node_id=str(raw.get("node_id", "")), mode="cluster" if raw.get("cluster_mode") else "single",
        admin=admin, paths=[str(p) for p in raw.get("paths", [])],
        capacity_bytes=[int(c) for c in raw.get("capacity", [])], units=int(raw.get("units", 0)),
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

    def ask(self, **msg: Any) -> dict[str, Any]:
        try:
            return self.pool.request(msg)
        except TuttiError as exc:
            raise daemon_error(exc) from exc

    @property
    def node_id(self) -> str:
        if self._node_id is None:
            self._node_id = str(self.ask(op="ping")["node_id"])
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
            h = self.pool.request({"op": "health"})  # in cluster mode the daemon asks etcd
            checks["daemon"] = True
        except (ApiError, TuttiError) as exc:
            checks["daemon"] = False
            reasons.append(f"node daemon: {exc.message if isinstance(exc, ApiError) else exc}")
            h = {"cluster_mode": self.config.cluster_mode, "etcd": False}
        if h.get("cluster_mode"):
            checks["etcd"] = bool(h.get("etcd"))
            if not checks["etcd"]:
                reasons.append("etcd: the node's cluster directory does not answer" if checks["daemon"]
                               else "etcd: not known (the node daemon does not answer)")
        return Readiness(ready=not reasons, reasons=reasons, checks=checks)

    # -- reads ------------------------------------------------------------------------------------
    def nodes(self) -> NodeList:
        return NodeList(nodes=[node_info_from(self.ask(op="stats"))])

    def node(self, node_id: str) -> NodeInfo:
        self._check_node(node_id)
        return node_info_from(self.ask(op="stats"))

    def stats(self) -> StatsResponse:
        return self._stats_from(self.ask(op="stats"))

    @staticmethod
    def _stats_from(raw: dict[str, Any]) -> StatsResponse:
        ns = node_stats_from(raw)
        return StatsResponse(totals=Counters(**{k: getattr(ns, k) for k in Counters.model_fields}), nodes=[ns])

    def snapshot(self) -> tuple[NodeList, StatsResponse]:
        """Nodes and stats from one daemon request (a metrics scrape)."""
        raw = self.ask(op="stats")
        return NodeList(nodes=[node_info_from(raw)]), self._stats_from(raw)

    def config_view(self) -> ConfigResponse:
        r = self.ask(op="config")
        return ConfigResponse(nodes={str(r["node_id"]): redact(dict(r["config"]))})

    def objects(self, keys: list[str] | None, prefix: str | None, limit: int) -> ObjectList:
        msg: dict[str, Any] = {"op": "objects", "limit": limit}
        if keys:
            msg["keys"] = [key_int(k) for k in keys]
        else:
            msg["prefix"] = (prefix or "").lower()
        r = self.ask(**msg)
        me = str(r.get("node_id") or self.node_id)
        out = []
        for o in r["objects"]:
            nodes = ([me] if o["instances"] else []) + [n for n in o.get("remote", []) if n != me]
            out.append(ObjectInfo(key=key_text(o["key"]), nodes=nodes,
                                  instances={me: list(o["instances"])} if o["instances"] else {},
                                  pinned=bool(o.get("pinned"))))
        return ObjectList(objects=out, truncated=bool(r.get("truncated")))

    # -- operations -------------------------------------------------------------------------------
    def evict(self, prefix: str | None, node: str | None, everything: bool, keys: list[str] | None = None) -> EvictResult:
        if node is not None:
            self._check_node(node)
        msg: dict[str, Any] = {"op": "remove_units"}
        if keys:
            msg["keys"] = [key_int(k) for k in keys]
        elif prefix is not None:
            msg["prefix"] = prefix.lower()
        else:
            msg["all"] = True
        r = self.ask(**msg)
        counts = {k: int(r.get(k, 0)) for k in ("evicted", "pinned_kept", "unreachable")}
        return EvictResult(evicted=counts["evicted"], pinned_kept=counts["pinned_kept"],
                           unreachable=counts["unreachable"], nodes={self.node_id: counts})

    def pin(self, keys: list[str]) -> PinResult:
        r = self.ask(op="pin", keys=[key_int(k) for k in keys])
        return PinResult(pinned=[key_text(k) for k in r["pinned"]], absent=[key_text(k) for k in r["absent"]],
                         unreachable=[key_text(k) for k in r["unreachable"]])

    def unpin(self, keys: list[str]) -> UnpinResult:
        r = self.ask(op="unpin", keys=[key_int(k) for k in keys])
        return UnpinResult(unpinned=[key_text(k) for k in r["unpinned"]],
                           not_pinned=[key_text(k) for k in r["not_pinned"]],
                           unreachable=[key_text(k) for k in r["unreachable"]])

    def pins(self) -> PinList:
        r = self.ask(op="pins")
        keys = sorted(key_text(k) for k in r["keys"])
        return PinList(pins=keys, count=len(keys))

    def drain(self, node_id: str, mode: str) -> tuple[str, DrainStatus]:
        self._check_node(node_id)
        return self.node_id, drain_from(self.ask(op="drain", mode=mode)["drain"])

    def undrain(self, node_id: str) -> tuple[str, DrainStatus]:
        self._check_node(node_id)
        return self.node_id, drain_from(self.ask(op="undrain")["drain"])

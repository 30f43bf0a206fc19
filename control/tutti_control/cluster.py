"""The cluster-wide admin (`tutti admin serve`): every node found in the cluster directory.

Nodes publish their admin API's address in their directory record (``tutti/n/<node_id>``, field
``admin``, written by `tutti up`). This backend reads the records from etcd
(:meth:`EtcdDirectory.refresh_nodes`) and asks each node's own admin API, concurrently, with the
same bearer token (one Secret for the whole cluster in the chart); answers are merged. A node that
does not answer is reported as unreachable, never as empty.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from tutti_cluster.cluster.auth import cluster_secret
from tutti_cluster.cluster.directory import EtcdDirectory, NodeRecord
from tutti_cluster.cluster.etcd import EtcdSecurity
from tutti_cluster.config import TuttiConfig

from tutti_control.backend import sum_counters
from tutti_control.errors import ApiError
from tutti_control.models import (
    ConfigResponse, Counters, DrainResponse, DrainStatus, EvictResult, NodeInfo, NodeList, NodeStats, ObjectInfo,
    ObjectList, PinList, PinResult, PinTier, Readiness, StatsResponse, UnpinResult, node_path,
)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class NodeUnavailable(Exception):
    """A node that does not answer, or answers what its admin API never would."""


def admin_url(admin: Any) -> str:
    """The base URL of a node's admin API from the ``admin`` field of its directory record, which
    must be ``host:port`` and nothing else (the record is another node's word: no path, query or
    user part, so the cluster's token goes to that address only)."""
    if not isinstance(admin, str) or not admin or len(admin) > 300:
        raise NodeUnavailable("the node serves no admin API (no admin address in its record)")
    try:
        url = httpx.URL(f"http://{admin}")
        ok = bool(url.host) and url.port is not None and f"{url.netloc.decode()}" == admin and url.raw_path == b"/"
    except (httpx.InvalidURL, UnicodeError, ValueError):
        ok = False
    if not ok:
        raise NodeUnavailable(f"the admin address in the node's record is not host:port: {admin[:100]!r}")
    return f"http://{admin}"


class ErrorShape(BaseModel):
    """The error object of a node's admin API, as far as this service reads it."""

    code: str = "error"
    message: str = ""
    details: dict[str, Any] = {}


class ClusterBackend:
    cluster = True
    name = "cluster"

    def __init__(self, config: TuttiConfig, token: str, timeout_s: float = 15.0) -> None:
        self.config = config
        self.directory = EtcdDirectory(",".join(config.etcd), f"admin-{socket.gethostname()}",
                                       max(2, config.lease_ttl_s), timeout_s=2.0,
                                       security=EtcdSecurity.from_config(config),
                                       secret=cluster_secret(config))  # only signed node records are believed
        self.http = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))
        self.pool = ThreadPoolExecutor(16, thread_name_prefix="tutti-admin-fanout")

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.http.close()
        if self.directory._client is not None:
            self.directory._client.close()

    # -- nodes ------------------------------------------------------------------------------------
    def records(self) -> dict[str, NodeRecord]:
        try:
            self.directory.client.count_prefix(b"tutti/n/")  # refresh_nodes keeps old records on failure
        except Exception as exc:
            raise ApiError(503, "directory_unavailable", f"the cluster directory (etcd) does not answer: {exc}") from exc
        return self.directory.refresh_nodes()

    def _record(self, node_id: str) -> NodeRecord:
        rec = self.records().get(node_id)
        if rec is None:
            raise ApiError(404, "node_not_found", f"no node {node_id!r} in the cluster directory", {"node_id": node_id})
        return rec

    def _call(self, rec: NodeRecord, method: str, path: str, model: type[M], **kw: Any) -> M:
        """One request to a node's admin API; its answer as ``model``. NodeUnavailable when the
        node does not answer, refuses the token, fails (5xx) or answers in another shape; ApiError
        with the node's own code for its 4xx."""
        admin = rec.extra.get("admin")
        base = admin_url(admin)
        try:
            r = self.http.request(method, base + path, **kw)
        except httpx.HTTPError as exc:
            raise NodeUnavailable(f"{admin}: {type(exc).__name__}: {exc}") from exc
        if r.status_code == 401:
            raise NodeUnavailable(f"{admin} refused the cluster's admin token")
        try:
            body = r.json()
        except ValueError as exc:
            raise NodeUnavailable(f"{admin} answered {r.status_code} without JSON") from exc
        err = body.get("error") if isinstance(body, dict) else None
        if r.status_code >= 400:
            try:
                e = ErrorShape.model_validate(err)
            except ValidationError:
                e = ErrorShape(message=f"an error of another shape: {str(err)[:200]}")
            if r.status_code >= 500:
                raise NodeUnavailable(f"{admin}: {r.status_code} {e.message}")
            raise ApiError(r.status_code, e.code, f"node {rec.node_id}: {e.message}", e.details)
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            raise NodeUnavailable(f"{admin} answered {r.status_code} with a body that is not a {model.__name__}: "
                                  f"{exc.errors()[0]['msg'] if exc.errors() else exc}") from exc

    def _each(self, fn: Callable[[NodeRecord], T], recs: dict[str, NodeRecord] | None = None) -> dict[str, T | NodeUnavailable]:
        """``fn`` on every node at once. A node's refusal (4xx) of a request this service already
        checked is that node's fault: it counts as unavailable, like no answer, and never fails the
        whole view."""
        recs = self.records() if recs is None else recs

        def one(rec: NodeRecord) -> T | NodeUnavailable:
            try:
                return fn(rec)
            except NodeUnavailable as exc:
                return exc
            except ApiError as exc:
                return NodeUnavailable(f"refused: {exc.status} {exc.code}: {exc.message}")

        return dict(zip(recs, self.pool.map(one, recs.values())))

    def _one(self, node_id: str, method: str, path: str, model: type[M], **kw: Any) -> M:
        rec = self._record(node_id)
        try:
            return self._call(rec, method, path, model, **kw)
        except NodeUnavailable as exc:
            raise ApiError(503, "node_unavailable", f"node {node_id}: {exc}", {"node_id": node_id}) from exc

    # -- health -----------------------------------------------------------------------------------
    def readiness(self) -> Readiness:
        try:
            self.directory.client.count_prefix(b"tutti/n/")
            return Readiness(ready=True, reasons=[], checks={"etcd": True})
        except Exception as exc:
            return Readiness(ready=False, reasons=[f"etcd: {exc}"], checks={"etcd": False})

    # -- reads ------------------------------------------------------------------------------------
    def _node_info(self, rec: NodeRecord, raw: Any) -> NodeInfo:
        if isinstance(raw, NodeUnavailable):
            return NodeInfo(node_id=rec.node_id, mode="cluster", reachable=False, error=str(raw),
                            admin=rec.extra.get("admin"))
        raw.admin = rec.extra.get("admin")
        return raw

    def nodes(self) -> NodeList:
        recs = self.records()
        got = self._each(lambda r: self._call(r, "GET", node_path(r.node_id), NodeInfo), recs)
        return NodeList(nodes=[self._node_info(recs[n], got[n]) for n in sorted(recs)])

    def node(self, node_id: str) -> NodeInfo:
        rec = self._record(node_id)
        return self._node_info(rec, self._one(node_id, "GET", node_path(node_id), NodeInfo))

    def stats(self) -> StatsResponse:
        got = self._each(lambda r: self._call(r, "GET", "/v1/stats", StatsResponse))
        nodes: list[NodeStats] = []
        for n in sorted(got):
            v = got[n]
            if isinstance(v, NodeUnavailable):
                nodes.append(NodeStats(node_id=n, reachable=False, error=str(v)))
            else:
                nodes.extend(v.nodes)
        tot = sum_counters([Counters(**{k: getattr(s, k) for k in Counters.model_fields}) for s in nodes if s.reachable])
        return StatsResponse(totals=tot, nodes=nodes)

    def snapshot(self) -> tuple[NodeList, StatsResponse]:
        return self.nodes(), self.stats()

    def config_view(self) -> ConfigResponse:
        got = self._each(lambda r: self._call(r, "GET", "/v1/config", ConfigResponse))
        out: dict[str, dict[str, Any]] = {}
        for n, v in sorted(got.items()):
            out.update({n: {"error": str(v)}} if isinstance(v, NodeUnavailable) else v.nodes)
        return ConfigResponse(nodes=out)

    def objects(self, keys: list[str] | None, prefix: str | None, limit: int) -> ObjectList:
        params: dict[str, Any] = {"limit": limit}
        if keys:
            params["key"] = keys
        else:
            params["prefix"] = prefix or ""
        got = self._each(lambda r: self._call(r, "GET", "/v1/objects", ObjectList, params=params))
        merged: dict[str, ObjectInfo] = {}
        truncated = False
        missing = sorted(n for n, v in got.items() if isinstance(v, NodeUnavailable))
        for v in got.values():
            if isinstance(v, NodeUnavailable):
                continue
            truncated |= v.truncated
            for o in v.objects:
                cur = merged.setdefault(o.key, ObjectInfo(key=o.key, nodes=[], instances={}, pinned=False))
                cur.nodes = sorted(set(cur.nodes) | set(o.nodes))
                cur.instances.update(o.instances)
                cur.tiers.update(o.tiers)
                cur.pinned |= o.pinned
        order = keys if keys else sorted(merged)
        objs = [merged[k] for k in dict.fromkeys(k.lower().rjust(16, "0") for k in order) if k in merged]
        if missing and not keys:
            truncated = True  # a node that did not answer may hold more
        return ObjectList(objects=objs[:limit], truncated=truncated or len(objs) > limit)

    # -- operations -------------------------------------------------------------------------------
    def evict(self, prefix: str | None, node: str | None, everything: bool, keys: list[str] | None = None) -> EvictResult:
        params: dict[str, Any] = {"all": "false", "prefix": prefix} if prefix is not None else {"all": "true"}
        recs = self.records()
        if node is not None:
            if node not in recs:
                raise ApiError(404, "node_not_found", f"no node {node!r} in the cluster directory", {"node_id": node})
            recs = {node: recs[node]}
        got = self._each(lambda r: self._call(r, "DELETE", "/v1/cache", EvictResult, params=params), recs)
        out = EvictResult(evicted=0, pinned_kept=0, unreachable=0)
        for n, v in sorted(got.items()):
            if isinstance(v, NodeUnavailable):
                out.unreachable_nodes.append(n)
                continue
            for k in ("evicted", "pinned_kept", "unreachable"):
                setattr(out, k, getattr(out, k) + getattr(v, k))
            out.nodes.update(v.nodes)
        return out

    def _keys_everywhere(self, method: str, body: dict[str, Any], model: type[PinResult] | type[UnpinResult],
                         done_field: str) -> tuple[list[str], set[str], set[str], list[PinResult | UnpinResult]]:
        """Pins or unpins ``body["keys"]`` on every node: (the keys normalised, those done somewhere,
        those not done whose node did not answer, every key when a node is away; the answers)."""
        got = self._each(lambda r: self._call(r, method, "/v1/pins", model, json=body))
        ok = [v for v in got.values() if not isinstance(v, NodeUnavailable)]
        norm = list(dict.fromkeys(k.lower().rjust(16, "0") for k in body["keys"]))
        done = {k for v in ok for k in getattr(v, done_field)}
        unreachable = {k for v in ok for k in v.unreachable} | (set(norm) if len(ok) < len(got) else set())
        return norm, done, unreachable - done, ok

    def pin(self, keys: list[str], tier: PinTier = "any") -> PinResult:
        norm, pinned, unreachable, ok = self._keys_everywhere("POST", {"keys": keys, "tier": tier}, PinResult, "pinned")
        no_memory = {k for v in ok if isinstance(v, PinResult) for k in v.no_memory_tier}
        return PinResult(pinned=[k for k in norm if k in pinned], unreachable=[k for k in norm if k in unreachable],
                         absent=[k for k in norm if k not in pinned and k not in unreachable],
                         no_memory_tier=[k for k in norm if k in no_memory])

    def unpin(self, keys: list[str]) -> UnpinResult:
        norm, done, unreachable, _ = self._keys_everywhere("DELETE", {"keys": keys}, UnpinResult, "unpinned")
        return UnpinResult(unpinned=[k for k in norm if k in done], unreachable=[k for k in norm if k in unreachable],
                           not_pinned=[k for k in norm if k not in done and k not in unreachable])

    def pins(self) -> PinList:
        got = self._each(lambda r: self._call(r, "GET", "/v1/pins", PinList))
        missing = [n for n, v in got.items() if isinstance(v, NodeUnavailable)]
        if missing:
            raise ApiError(503, "node_unavailable", f"cannot list every pin: no answer from {', '.join(sorted(missing))}",
                           {"nodes": sorted(missing)})
        # A key pinned for memory on any node shows tier memory (nodes differ only where one was
        # away when it was pinned).
        tiers: dict[str, PinTier] = {}
        for v in got.values():
            if not isinstance(v, NodeUnavailable):
                for k in v.pins:
                    tiers[k] = "memory" if v.tiers.get(k) == "memory" or tiers.get(k) == "memory" else "any"
        keys = sorted(tiers)
        return PinList(pins=keys, count=len(keys), tiers={k: tiers[k] for k in keys})

    def drain(self, node_id: str, mode: str) -> tuple[str, DrainStatus]:
        return node_id, self._one(node_id, "POST", node_path(node_id, "/drain"), DrainResponse, json={"mode": mode}).drain

    def undrain(self, node_id: str) -> tuple[str, DrainStatus]:
        return node_id, self._one(node_id, "DELETE", node_path(node_id, "/drain"), DrainResponse).drain

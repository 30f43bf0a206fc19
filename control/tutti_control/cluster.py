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

from tutti_cluster.cluster.directory import EtcdDirectory, NodeRecord
from tutti_cluster.config import TuttiConfig

from tutti_control.backend import sum_counters
from tutti_control.errors import ApiError
from tutti_control.models import (
    ConfigResponse, Counters, DrainStatus, EvictResult, NodeInfo, NodeList, NodeStats, ObjectInfo, ObjectList,
    PinList, PinResult, Readiness, StatsResponse, UnpinResult,
)

T = TypeVar("T")


class NodeUnavailable(Exception):
    pass


class ClusterBackend:
    cluster = True
    name = "cluster"

    def __init__(self, config: TuttiConfig, token: str, timeout_s: float = 15.0) -> None:
        self.config = config
        self.directory = EtcdDirectory(",".join(config.etcd), f"admin-{socket.gethostname()}",
                                       max(2, config.lease_ttl_s), timeout_s=2.0)
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

    def _call(self, rec: NodeRecord, method: str, path: str, **kw: Any) -> Any:
        admin = rec.extra.get("admin")
        if not admin:
            raise NodeUnavailable("the node serves no admin API (no admin address in its record)")
        try:
            r = self.http.request(method, f"http://{admin}{path}", **kw)
        except httpx.HTTPError as exc:
            raise NodeUnavailable(f"{admin}: {type(exc).__name__}: {exc}") from exc
        if r.status_code == 401:
            raise NodeUnavailable(f"{admin} refused the cluster's admin token")
        try:
            body = r.json()
        except ValueError as exc:
            raise NodeUnavailable(f"{admin} answered {r.status_code} without JSON") from exc
        if r.status_code >= 500:
            raise NodeUnavailable(f"{admin}: {r.status_code} {body.get('error', {}).get('message', '')}")
        if r.status_code >= 400:
            e = body.get("error", {})
            raise ApiError(r.status_code, str(e.get("code", "error")), f"node {rec.node_id}: {e.get('message', '')}",
                           dict(e.get("details", {})))
        return body

    def _each(self, fn: Callable[[NodeRecord], T], recs: dict[str, NodeRecord] | None = None) -> dict[str, T | NodeUnavailable]:
        recs = self.records() if recs is None else recs

        def one(rec: NodeRecord) -> T | NodeUnavailable:
            try:
                return fn(rec)
            except NodeUnavailable as exc:
                return exc

        return dict(zip(recs, self.pool.map(one, recs.values())))

    def _one(self, node_id: str, method: str, path: str, **kw: Any) -> Any:
        rec = self._record(node_id)
        try:
            return self._call(rec, method, path, **kw)
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
        info = NodeInfo.model_validate(raw)
        info.admin = rec.extra.get("admin")
        return info

    def nodes(self) -> NodeList:
        recs = self.records()
        got = self._each(lambda r: self._call(r, "GET", f"/v1/nodes/{r.node_id}"), recs)
        return NodeList(nodes=[self._node_info(recs[n], got[n]) for n in sorted(recs)])

    def node(self, node_id: str) -> NodeInfo:
        rec = self._record(node_id)
        return self._node_info(rec, self._one(node_id, "GET", f"/v1/nodes/{node_id}"))

    def stats(self) -> StatsResponse:
        got = self._each(lambda r: self._call(r, "GET", "/v1/stats"))
        nodes = []
        for n in sorted(got):
            v = got[n]
            if isinstance(v, NodeUnavailable):
                nodes.append(NodeStats(node_id=n, reachable=False, error=str(v)))
            else:
                nodes.extend(NodeStats.model_validate(x) for x in v["nodes"])
        tot = sum_counters([Counters(**{k: getattr(s, k) for k in Counters.model_fields}) for s in nodes if s.reachable])
        return StatsResponse(totals=tot, nodes=nodes)

    def snapshot(self) -> tuple[NodeList, StatsResponse]:
        return self.nodes(), self.stats()

    def config_view(self) -> ConfigResponse:
        got = self._each(lambda r: self._call(r, "GET", "/v1/config"))
        out: dict[str, dict[str, Any]] = {}
        for n, v in sorted(got.items()):
            out.update({n: {"error": str(v)}} if isinstance(v, NodeUnavailable) else v["nodes"])
        return ConfigResponse(nodes=out)

    def objects(self, keys: list[str] | None, prefix: str | None, limit: int) -> ObjectList:
        params: dict[str, Any] = {"limit": limit}
        if keys:
            params["key"] = keys
        else:
            params["prefix"] = prefix or ""
        got = self._each(lambda r: self._call(r, "GET", "/v1/objects", params=params))
        merged: dict[str, ObjectInfo] = {}
        truncated = False
        missing = sorted(n for n, v in got.items() if isinstance(v, NodeUnavailable))
        for v in got.values():
            if isinstance(v, NodeUnavailable):
                continue
            truncated |= bool(v["truncated"])
            for o in v["objects"]:
                cur = merged.setdefault(o["key"], ObjectInfo(key=o["key"], nodes=[], instances={}, pinned=False))
                cur.nodes = sorted(set(cur.nodes) | set(o["nodes"]))
                cur.instances.update(o["instances"])
                cur.pinned |= bool(o["pinned"])
        order = keys if keys else sorted(merged)
        objs = [merged[k] for k in dict.fromkeys(k.lower().rjust(16, "0") for k in order) if k in merged]
        if missing and not keys:
            truncated = True  # a node that did not answer may hold more
        return ObjectList(objects=objs[:limit], truncated=truncated or len(objs) > limit)

    # -- operations -------------------------------------------------------------------------------
    def evict(self, prefix: str | None, node: str | None, everything: bool, keys: list[str] | None = None) -> EvictResult:
        params: dict[str, Any] = {"prefix": prefix} if prefix is not None else {"all": "true"}
        recs = self.records()
        if node is not None:
            if node not in recs:
                raise ApiError(404, "node_not_found", f"no node {node!r} in the cluster directory", {"node_id": node})
            recs = {node: recs[node]}
        got = self._each(lambda r: self._call(r, "DELETE", "/v1/cache", params=params), recs)
        out = EvictResult(evicted=0, pinned_kept=0, unreachable=0)
        for n, v in sorted(got.items()):
            if isinstance(v, NodeUnavailable):
                out.unreachable_nodes.append(n)
                continue
            for k in ("evicted", "pinned_kept", "unreachable"):
                setattr(out, k, getattr(out, k) + int(v[k]))
            out.nodes.update(v["nodes"])
        return out

    def _keys_everywhere(self, method: str, keys: list[str], done_field: str) -> tuple[list[str], set[str], set[str]]:
        """Pins or unpins ``keys`` on every node: (the keys normalised, those done somewhere, those
        not done whose node did not answer; every key when a node is away)."""
        got = self._each(lambda r: self._call(r, method, "/v1/pins", json={"keys": keys}))
        ok = [v for v in got.values() if not isinstance(v, NodeUnavailable)]
        norm = list(dict.fromkeys(k.lower().rjust(16, "0") for k in keys))
        done = {k for v in ok for k in v[done_field]}
        unreachable = {k for v in ok for k in v["unreachable"]} | (set(norm) if len(ok) < len(got) else set())
        return norm, done, unreachable - done

    def pin(self, keys: list[str]) -> PinResult:
        norm, pinned, unreachable = self._keys_everywhere("POST", keys, "pinned")
        return PinResult(pinned=[k for k in norm if k in pinned], unreachable=[k for k in norm if k in unreachable],
                         absent=[k for k in norm if k not in pinned and k not in unreachable])

    def unpin(self, keys: list[str]) -> UnpinResult:
        norm, done, unreachable = self._keys_everywhere("DELETE", keys, "unpinned")
        return UnpinResult(unpinned=[k for k in norm if k in done], unreachable=[k for k in norm if k in unreachable],
                           not_pinned=[k for k in norm if k not in done and k not in unreachable])

    def pins(self) -> PinList:
        got = self._each(lambda r: self._call(r, "GET", "/v1/pins"))
        missing = [n for n, v in got.items() if isinstance(v, NodeUnavailable)]
        if missing:
            raise ApiError(503, "node_unavailable", f"cannot list every pin: no answer from {', '.join(sorted(missing))}",
                           {"nodes": sorted(missing)})
        keys = sorted({k for v in got.values() if not isinstance(v, NodeUnavailable) for k in v["pins"]})
        return PinList(pins=keys, count=len(keys))

    def drain(self, node_id: str, mode: str) -> tuple[str, DrainStatus]:
        r = self._one(node_id, "POST", f"/v1/nodes/{node_id}/drain", json={"mode": mode})
        return node_id, DrainStatus.model_validate(r["drain"])

    def undrain(self, node_id: str) -> tuple[str, DrainStatus]:
        r = self._one(node_id, "DELETE", f"/v1/nodes/{node_id}/drain")
        return node_id, DrainStatus.model_validate(r["drain"])

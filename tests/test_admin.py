"""The node's admin API (tutti_control) in process over ASGI, against a real node daemon process and
a real engine process (TuttiStore attached through the daemon socket): every route, every error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

fastapi = pytest.importorskip("fastapi", reason="the admin extra is not installed (pip install '.[admin]')")
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from admin_fixtures import AUTH, TOKEN, AdminNode, hexkey, served_admin, wait_for  # noqa: E402
from tutti_cluster import TuttiConfig  # noqa: E402
from tutti_cluster.node.link import DaemonLink  # noqa: E402
from tutti_cluster.errors import CapacityExceeded  # noqa: E402
from tutti_control.app import create_app  # noqa: E402
from tutti_control.backend import NodeBackend  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
V1_ROUTES = [("GET", "/v1/nodes"), ("GET", "/v1/nodes/node-a"), ("GET", "/v1/stats"), ("GET", "/v1/config"),
             ("GET", "/v1/objects?prefix="), ("DELETE", "/v1/cache?all=true"), ("GET", "/v1/pins"),
             ("POST", "/v1/pins"), ("DELETE", "/v1/pins"), ("POST", "/v1/nodes/node-a/drain"),
             ("DELETE", "/v1/nodes/node-a/drain")]
DAEMON_SECRET = "daemon-config-secret-xyz"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AdminNode]:
    n = AdminNode(tmp_path_factory.mktemp("admin"), admin_token=DAEMON_SECRET)
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(scope="module")
def client(node: AdminNode) -> Iterator[TestClient]:
    backend = NodeBackend(node.config)
    with TestClient(create_app(backend, TOKEN), raise_server_exceptions=False) as c:
        # The engine's command channel is up once the daemon lists it as connected.
        assert wait_for(lambda: c.get("/v1/nodes/node-a", headers=AUTH).json()["instances"][0]["engine_connected"])
        yield c
    backend.close()


def is_error(r: Any, status: int, code: str | None = None) -> dict:
    """``r`` is an error of ``status`` in the one stable shape; returns its ``error`` object."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def state(c: TestClient, node: AdminNode, keys: list[int]) -> tuple:
    """Everything a bad request could change: pins, units, the engine's hits and pinned count."""
    pins = c.get("/v1/pins", headers=AUTH).json()
    objs = c.get("/v1/objects", params={"prefix": ""}, headers=AUTH).json()
    st = node.engine_stats()
    assert node.engine is not None
    return pins, objs, node.engine.call(op="lookup", keys=keys)["local"], st["pinned"], st["units"]


# -- health and auth ------------------------------------------------------------------------------
def test_health_and_metrics_are_open(client: TestClient):
    assert client.get("/livez").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json() == {"ready": True, "reasons": [], "checks": {"daemon": True}}
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "tutti_node_up" in {f.name for f in text_string_to_metric_families(r.text)}


@pytest.mark.parametrize("method,path", V1_ROUTES)
@pytest.mark.parametrize("header", [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x",
                                    f"Bearer {TOKEN[:-1]}", "Bearer"])
def test_every_v1_route_needs_the_bearer_token(client: TestClient, node: AdminNode, method: str, path: str,
                                               header: str | None):
    before = state(client, node, [1])
    headers = {"Authorization": header} if header is not None else {}
    r = client.request(method, path, headers=headers, json={"keys": ["1"]} if "pins" in path else None)
    is_error(r, 401, "unauthorized")
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert state(client, node, [1]) == before


# -- reads ----------------------------------------------------------------------------------------
def test_nodes_node_stats_and_config(client: TestClient, node: AdminNode):
    keys = [0x1000 + i for i in range(6)]
    node.store(keys)
    assert node.engine is not None
    assert node.engine.call(op="lookup", keys=keys + [0x1fff])["local"] == len(keys)
    nodes = client.get("/v1/nodes", headers=AUTH).json()["nodes"]
    assert [n["node_id"] for n in nodes] == ["node-a"] and nodes[0]["mode"] == "single"
    one = client.get("/v1/nodes/node-a", headers=AUTH).json()
    assert one["units"] >= len(keys) and one["paths"] == node.cfg["paths"]
    inst = one["instances"][0]
    assert inst["name"] == "engine0" and inst["engine_connected"] and inst["capacity_bytes"][0] > 0
    assert one["drain"]["state"] == "serving"
    is_error(client.get("/v1/nodes/other", headers=AUTH), 404, "node_not_found")

    # The engine reports its store's counters on its command channel (at most 2 s old).
    eng = node.engine_stats()

    def caught_up() -> dict | None:
        s = client.get("/v1/stats", headers=AUTH).json()
        t = s["totals"]
        return s if t["bytes_written"] >= eng["bytes_written"] and t["lookups"] >= eng["lookups"] else None

    s = wait_for(caught_up, 10)
    assert s, "the engine's counters did not reach the daemon"
    t = s["totals"]
    assert t["bytes_written"] == eng["bytes_written"] > 0
    assert t["lookups"] == eng["lookups"] and t["hits"] == eng["hits"] and t["misses"] == eng["lookups"] - eng["hits"]
    assert t["units"] == one["units"] and t["used_bytes"] == eng["slot_bytes"] * (eng["total_slots"] - eng["free_slots"])
    assert s["nodes"][0]["instances"]["engine0"]["bytes_written"] == eng["bytes_written"]

    r = client.get("/v1/config", headers=AUTH)
    cfg = r.json()["nodes"]["node-a"]
    assert cfg["paths"] == node.cfg["paths"] and cfg["unit_tokens"] == 64 and cfg["node_id"] == "node-a"
    assert cfg["admin_token"] == "<redacted>" and DAEMON_SECRET not in r.text


def test_objects_by_key_prefix_and_limit(client: TestClient, node: AdminNode):
    keys = [0x2a00 + i for i in range(5)]
    node.store(keys)
    r = client.get("/v1/objects", params={"key": [hexkey(keys[0]), "2A01", "dead"]}, headers=AUTH).json()
    assert [o["key"] for o in r["objects"]] == [hexkey(keys[0]), hexkey(keys[1]), hexkey(0xdead)]
    assert r["objects"][0]["nodes"] == ["node-a"] and r["objects"][0]["instances"] == {"node-a": ["engine0"]}
    assert r["objects"][2]["nodes"] == [] and not r["truncated"]
    r = client.get("/v1/objects", params={"prefix": "0000000000002a0"}, headers=AUTH).json()
    assert [o["key"] for o in r["objects"]] == [hexkey(k) for k in keys] and not r["truncated"]
    r = client.get("/v1/objects", params={"prefix": "0000000000002a", "limit": 2}, headers=AUTH).json()
    assert len(r["objects"]) == 2 and r["truncated"]
    # key and prefix together: the given keys that match; neither: every unit.
    r = client.get("/v1/objects", params={"key": [hexkey(keys[0]), "1000"], "prefix": "00000000000010"},
                   headers=AUTH).json()
    assert [o["key"] for o in r["objects"]] == [hexkey(0x1000)]
    everything = client.get("/v1/objects", headers=AUTH).json()["objects"]
    assert {hexkey(k) for k in keys} <= {o["key"] for o in everything}


# -- pins and evictions ---------------------------------------------------------------------------
def test_pin_unpin_and_list(client: TestClient, node: AdminNode):
    keys = [0x3b00 + i for i in range(4)]
    node.store(keys)
    pinned_before = node.engine_stats()["pinned"]
    r = client.post("/v1/pins", json={"keys": [hexkey(k) for k in keys[:3]] + ["3bff"]}, headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {"pinned": [hexkey(k) for k in keys[:3]], "absent": [hexkey(0x3bff)], "unreachable": [],
                        "no_memory_tier": []}
    # Pinning again changes nothing: one store pin per key, however often it is asked for. A memory
    # pin where the engine has no memory tier still pins, and says it could not put the unit in memory.
    assert client.post("/v1/pins", json={"keys": [hexkey(keys[0])]}, headers=AUTH).json()["pinned"] == [hexkey(keys[0])]
    r = client.post("/v1/pins", json={"keys": [hexkey(keys[1]), "3bff"], "tier": "memory"}, headers=AUTH).json()
    assert r == {"pinned": [hexkey(keys[1])], "absent": [hexkey(0x3bff)], "unreachable": [],
                 "no_memory_tier": [hexkey(keys[1])]}
    assert node.engine_stats()["pinned"] == pinned_before + 3
    listed = client.get("/v1/pins", headers=AUTH).json()
    assert {hexkey(k) for k in keys[:3]} <= set(listed["pins"]) and listed["count"] == len(listed["pins"])
    assert {k: listed["tiers"][hexkey(k)] for k in keys[:3]} == {keys[0]: "any", keys[1]: "memory", keys[2]: "any"}
    objs = client.get("/v1/objects", params={"key": [hexkey(k) for k in keys]}, headers=AUTH).json()["objects"]
    assert [o["pinned"] for o in objs] == [True, True, True, False]
    assert [o["tiers"] for o in objs] == [{"node-a": {"engine0": "storage"}}] * 4  # no memory tier here

    r = client.request("DELETE", "/v1/pins", json={"keys": [hexkey(keys[0]), hexkey(keys[3])]}, headers=AUTH)
    assert r.json() == {"unpinned": [hexkey(keys[0])], "not_pinned": [hexkey(keys[3])], "unreachable": []}
    assert node.engine_stats()["pinned"] == pinned_before + 2
    client.request("DELETE", "/v1/pins", json={"keys": [hexkey(k) for k in keys[1:3]]}, headers=AUTH)
    assert node.engine_stats()["pinned"] == pinned_before
    assert not {hexkey(k) for k in keys} & set(client.get("/v1/pins", headers=AUTH).json()["pins"])


def test_evict_by_prefix_node_and_all_keeps_pinned_units(client: TestClient, node: AdminNode):
    assert node.engine is not None
    a = [0x4c00 + i for i in range(4)]
    b = [0x4d00 + i for i in range(3)]
    node.store(a + b)
    client.post("/v1/pins", json={"keys": [hexkey(a[0])]}, headers=AUTH)
    r = client.delete("/v1/cache", params={"all": "false", "prefix": "0000000000004c"}, headers=AUTH).json()
    assert (r["evicted"], r["pinned_kept"], r["unreachable"]) == (3, 1, 0)
    assert r["nodes"] == {"node-a": {"evicted": 3, "pinned_kept": 1, "unreachable": 0}}
    # Gone from the engine's store and from the daemon's index at once.
    assert [node.engine.call(op="lookup", keys=[k])["local"] for k in a] == [1, 0, 0, 0]
    left = client.get("/v1/objects", params={"prefix": "0000000000004"}, headers=AUTH).json()["objects"]
    assert [o["key"] for o in left] == [hexkey(a[0])] + [hexkey(k) for k in b]
    is_error(client.delete("/v1/cache", params={"all": "false", "node": "elsewhere"}, headers=AUTH), 404,
             "node_not_found")
    # An explicit selector is required (the schema says so): without `all` the request is invalid,
    # and `all=false` alone selects, and evicts, nothing.
    is_error(client.delete("/v1/cache", headers=AUTH), 422, "invalid_request")
    is_error(client.delete("/v1/cache", params={"prefix": "0000000000004d"}, headers=AUTH), 422, "invalid_request")
    assert client.delete("/v1/cache", params={"all": "false"}, headers=AUTH).json()["evicted"] == 0
    assert node.engine.call(op="lookup", keys=b)["local"] == 3
    r = client.delete("/v1/cache", params={"all": "false", "node": "node-a", "prefix": "0000000000004d"},
                      headers=AUTH).json()
    assert r["evicted"] == 3 and node.engine.call(op="lookup", keys=b)["local"] == 0
    r = client.delete("/v1/cache", params={"all": "true"}, headers=AUTH).json()
    assert r["pinned_kept"] >= 1 and node.engine.call(op="lookup", keys=a[:1])["local"] == 1
    assert client.get("/v1/nodes/node-a", headers=AUTH).json()["units"] == r["pinned_kept"]
    client.request("DELETE", "/v1/pins", json={"keys": [hexkey(a[0])]}, headers=AUTH)
    assert client.delete("/v1/cache", params={"all": "true"}, headers=AUTH).json()["evicted"] >= 1
    assert node.engine.call(op="lookup", keys=a[:1])["local"] == 0


def test_metrics_follow_the_node(client: TestClient, node: AdminNode):
    keys = [0x5e00 + i for i in range(3)]
    node.store(keys)
    client.post("/v1/pins", json={"keys": [hexkey(keys[0])]}, headers=AUTH)
    eng = node.engine_stats()

    def scrape() -> dict:
        out = {}
        for fam in text_string_to_metric_families(client.get("/metrics").text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    inst = (("instance", "engine0"), ("node", "node-a"))
    m = wait_for(lambda: (lambda m: m if m[("tutti_written_bytes_total", inst)] >= eng["bytes_written"]
                          and m[("tutti_pinned_units", inst)] == eng["pinned"] else None)(scrape()), 10)
    assert m, "metrics did not catch up with the engine"
    units = client.get("/v1/nodes/node-a", headers=AUTH).json()["units"]
    assert m[("tutti_node_up", (("node", "node-a"),))] == 1
    assert m[("tutti_node_units", (("node", "node-a"),))] == units
    assert m[("tutti_pinned_units", inst)] == eng["pinned"] >= 1
    assert m[("tutti_hits_total", inst)] == eng["hits"]
    assert m[("tutti_misses_total", inst)] == eng["lookups"] - eng["hits"]
    assert m[("tutti_checksum_failures_total", inst)] == eng["checksum_failures"]
    path = (("node", "node-a"), ("path", node.cfg["paths"][0]))
    assert m[("tutti_path_capacity_bytes", path)] == TuttiConfig(**node.cfg).capacity_bytes()[0]
    assert m[("tutti_path_allocated_bytes", path)] > 0
    for name in ("tutti_read_bandwidth_bytes_per_second", "tutti_evictions_total", "tutti_remote_fetch_units_total",
                 "tutti_remote_served_units_total", "tutti_directory_errors_total", "tutti_io_errors_total"):
        assert any(k[0] == name for k in m), name
    assert m[("tutti_queue_depth", inst + (("queue", "admin_commands"),))] == 0
    assert any(k[0] == "tutti_admin_requests_total" for k in m)
    client.request("DELETE", "/v1/pins", json={"keys": [hexkey(keys[0])]}, headers=AUTH)


# -- bad input ------------------------------------------------------------------------------------
BIG = b'{"keys": [' + b",".join(b'"%016x"' % i for i in range(60000)) + b"]}"


def _chunks() -> Iterator[bytes]:
    for i in range(0, len(BIG), 65536):
        yield BIG[i:i + 65536]


BAD = [
    # (method, path, kwargs, status, code)
    ("POST", "/v1/pins", {"content": b'{"keys": ["5000"', "headers": {"content-type": "application/json"}}, 422, "invalid_request"),
    ("POST", "/v1/pins", {"content": b"\xff\xfe not json", "headers": {"content-type": "application/json"}}, 400, "bad_request"),
    ("POST", "/v1/pins", {"content": BIG, "headers": {"content-type": "application/json"}}, 413, "body_too_large"),
    ("POST", "/v1/pins", {"content": _chunks, "headers": {"content-type": "application/json"}}, 413, "body_too_large"),
    ("POST", "/v1/pins", {"json": {"keys": "4c00"}}, 422, "invalid_request"),
    ("POST", "/v1/pins", {"json": {"keys": [0x4c00]}}, 422, "invalid_request"),
    ("POST", "/v1/pins", {"json": {"keys": []}}, 422, "invalid_request"),
    ("POST", "/v1/pins", {"json": {"keys": ["%016x" % i for i in range(4097)]}}, 422, "invalid_request"),
    ("POST", "/v1/pins", {"json": {"keys": ["12345678901234567"]}}, 422, "invalid_request"),
    ("POST", "/v1/pins", {"json": {"keys": ["4c00"], "force": True}}, 422, "invalid_request"),
    ("POST", "/v1/pins", {"json": ["4c00"]}, 422, "invalid_request"),
    ("POST", "/v1/pins", {}, 422, "invalid_request"),
    ("POST", "/v1/pins", {"content": b"keys=4c00", "headers": {"content-type": "text/plain"}}, 422, "invalid_request"),
    ("DELETE", "/v1/pins", {"json": {"keys": ["../../etc/passwd"]}}, 422, "invalid_request"),
    ("GET", "/v1/objects?prefix=../../etc", {}, 422, "invalid_request"),
    ("GET", "/v1/objects?prefix=4c%2F..%2F..", {}, 422, "invalid_request"),
    ("GET", "/v1/objects?prefix=%00", {}, 422, "invalid_request"),
    ("GET", "/v1/objects?key=..%2F4c00", {}, 422, "invalid_request"),
    ("GET", "/v1/objects?limit=0", {}, 422, "invalid_request"),
    ("GET", "/v1/objects?limit=ten", {}, 422, "invalid_request"),
    ("GET", "/v1/objects?prefx=4c", {}, 422, "invalid_request"),
    ("DELETE", "/v1/cache?prefix=..%2F..%2F", {}, 422, "invalid_request"),
    ("DELETE", "/v1/cache?prefix=/", {}, 422, "invalid_request"),
    ("DELETE", "/v1/cache?prefix=", {}, 422, "invalid_request"),
    ("DELETE", "/v1/cache?prefx=4c", {}, 422, "invalid_request"),
    ("DELETE", "/v1/cache?all=yes-please", {}, 422, "invalid_request"),
    ("DELETE", "/v1/cache?all=true&everything=1", {}, 422, "invalid_request"),
    ("DELETE", "/v1/cache?node=..%2Fnode-a", {}, 422, "invalid_request"),
    ("DELETE", "/v1/cache", {}, 422, "invalid_request"),
    ("DELETE", "/v1/cache?prefix=4c", {}, 422, "invalid_request"),
    ("POST", "/v1/nodes/node-a/drain", {"json": {"mode": 3}}, 422, "invalid_request"),
    ("POST", "/v1/nodes/node-a/drain", {"json": {"mode": "everything"}}, 422, "invalid_request"),
    ("POST", "/v1/nodes/node-a/drain", {"json": {"mode": "all", "now": True}}, 422, "invalid_request"),
    ("POST", "/v1/nodes/..%2F..%2Fetc/drain", {}, 404, None),
    ("POST", "/v1/nodes/.hidden/drain", {}, 404, "node_not_found"),  # a valid id (the directory's rules)
    ("POST", "/v1/nodes/%EF%BF%BD/drain", {}, 422, "invalid_request"),  # U+FFFD: no directory id holds it
    ("POST", "/v1/nodes/other/drain", {}, 404, "node_not_found"),
    ("GET", "/v1/nodes/node-a?verbose=1", {}, 422, "invalid_request"),
    ("PUT", "/v1/pins", {"json": {"keys": ["4c00"]}}, 405, "method_not_allowed"),
    ("GET", "/v1/nothing-here", {}, 404, "not_found"),
    ("GET", "/v1/%2e%2e/livez", {}, 404, None),
]


def test_bad_input_is_a_4xx_with_the_stable_shape_and_changes_nothing(client: TestClient, node: AdminNode):
    keys = [0x4c00 + i for i in range(3)]
    node.store(keys)
    client.post("/v1/pins", json={"keys": [hexkey(keys[0])]}, headers=AUTH)
    before = state(client, node, keys)
    for method, path, kw, status, code in BAD:
        kw = dict(kw)
        if callable(kw.get("content")):
            kw["content"] = kw["content"]()
        headers = {**AUTH, **kw.pop("headers", {})}
        r = client.request(method, path, headers=headers, **kw)
        if r.status_code == 404 and code is None:
            continue  # the router's own 404 (a path that names no route): checked for shape below
        err = is_error(r, status, code)
        if status == 422:
            assert err["details"]["errors"] and all({"loc", "msg", "type"} == set(e) for e in err["details"]["errors"])
        if status == 405:
            assert set(r.headers["allow"].split(", ")) == {"GET", "POST", "DELETE"}
    for method, path, _, _, code in BAD:
        if code is None:
            r = client.request(method, path, headers=AUTH)
            assert 400 <= r.status_code < 500 and set(r.json()["error"]) == {"code", "message", "details"}
    assert state(client, node, keys) == before
    client.request("DELETE", "/v1/pins", json={"keys": [hexkey(keys[0])]}, headers=AUTH)


def test_an_engine_report_with_text_counters_is_refused_and_the_node_stays_up(client: TestClient, node: AdminNode):
    """An engine's ``commands`` report is arithmetic for the daemon (rates) and the admin plane
    (totals, metrics): text where a number belongs is refused, and the instance's channel and the
    node's routes keep working (before, one such report made /v1/stats and /v1/nodes answer 500 and
    the node's metrics say it was down, and every later poll of the instance fail)."""
    from tutti_cluster.errors import ConfigError

    link = DaemonLink(node.config, timeout_s=5.0)
    geometry = {"num_layers": 2, "nptr": 2, "block_stride": 4096, "block_bytes": 4096, "num_blocks": 64,
                "dtype": "uint8", "block_shape": [4096], "block_tokens": 16, "unit_tokens": 64}
    try:
        assert link.request({"op": "attach", "instance": "liar", "geometry": geometry, "capacity": [1 << 20]})["ok"]
        for stats in ({"units": "many"}, {"bytes_read": "12 GB"}, {"bytes_written": 1e400}, {"hits": 10 ** 400}):
            with pytest.raises(ConfigError):
                link.request({"op": "commands", "instance": "liar", "wait_ms": 0, "stats": stats})
        assert link.request({"op": "commands", "instance": "liar", "wait_ms": 0,
                             "stats": {"backend": "cpu", "bytes_read": 5}})["ok"]
        for path in ("/v1/stats", "/v1/nodes", "/v1/nodes/node-a"):
            assert client.get(path, headers=AUTH).status_code == 200, path
        assert "tutti_node_up{node=\"node-a\"} 1.0" in client.get("/metrics").text
    finally:
        link.close()


def test_connections_that_never_send_a_whole_request_are_closed_and_capped(node: AdminNode, monkeypatch):
    """Slow or silent clients cannot hold the admin server's (and so the daemon's) file descriptors:
    a request head must be whole within HEAD_TIMEOUT_S, however it trickles in, and connections past
    MAX_CONNECTIONS are closed at once; well-behaved clients, keep-alive ones too, are served."""
    import socket

    import httpx
    from admin_fixtures import served_admin
    from tutti_control import serve

    monkeypatch.setattr(serve, "HEAD_TIMEOUT_S", 1.0)
    monkeypatch.setattr(serve, "MAX_CONNECTIONS", 16)

    def closed(s: socket.socket, within_s: float) -> bool:
        s.settimeout(within_s)
        try:
            return s.recv(1) == b""
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True

    with served_admin(node) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        socks = []
        try:
            for _ in range(32):
                s = socket.create_connection((host, int(port)))
                s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")  # never the blank line
                socks.append(s)
            t0 = time.monotonic()
            assert sum(closed(s, 0.05) for s in socks) >= 16  # past the cap: closed at once
            assert all(closed(s, 3.0) for s in socks)  # the rest: at the head deadline
            assert time.monotonic() - t0 < 4.0
            trickle = socket.create_connection((host, int(port)))
            socks.append(trickle)
            t0 = time.monotonic()
            with pytest.raises((BrokenPipeError, ConnectionResetError)):
                for c in b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
                    trickle.sendall(bytes([c]))
                    time.sleep(0.05)
            assert time.monotonic() - t0 < 3.0
            with httpx.Client(base_url=url) as c:  # one keep-alive connection, pauses under the deadline
                for _ in range(3):
                    assert c.get("/livez").status_code == 200
                    time.sleep(0.5)
        finally:
            for s in socks:
                s.close()


def test_daemon_refusals_map_to_400_and_anything_else_to_502():
    from tutti_cluster.errors import ConfigError, NotFound, StorageError
    from tutti_control.backend import daemon_error

    assert (daemon_error(ConfigError("bad")).status, daemon_error(ConfigError("bad")).code) == (400, "bad_request")
    for exc in (NotFound("gone"), StorageError("disk"), CapacityExceeded("full")):
        e = daemon_error(exc)
        assert (e.status, e.code, e.details) == (502, "daemon_error", {"class": type(exc).__name__})


def test_no_daemon_is_503_and_readyz_says_why(tmp_path: Path):
    cfg = TuttiConfig(data_dir=tmp_path / "nobody-home", paths=[tmp_path])
    backend = NodeBackend(cfg)
    with TestClient(create_app(backend, TOKEN)) as c:
        assert c.get("/livez").status_code == 200
        r = c.get("/readyz")
        assert r.status_code == 503 and not r.json()["ready"] and r.json()["checks"] == {"daemon": False}
        assert "node daemon" in r.json()["reasons"][0]
        for method, path in V1_ROUTES:
            r = c.request(method, path, headers=AUTH, json={"keys": ["1"]} if "pins" in path else None)
            is_error(r, 503, "daemon_unavailable")
        m = c.get("/metrics")
        assert m.status_code == 200 and "tutti_node_up" in m.text
    backend.close()


# -- schema ---------------------------------------------------------------------------------------
def test_openapi_is_committed_and_lists_every_status():
    from tutti_control.openapi import schema, text

    committed = (REPO / "docs" / "openapi.json").read_text()
    assert committed == text(), "docs/openapi.json is stale: python -m tutti_control.openapi > docs/openapi.json"
    s = schema()
    for path, ops in s["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            assert "200" in codes and "413" in codes, (method, path)
            if path.startswith("/v1/"):
                assert {"401", "422", "503"} <= codes, (method, path)
                assert op["security"] == [{"HTTPBearer": []}], (method, path)
                for code in codes - {"200"}:
                    ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorBody"), (method, path, code)
    assert "/v1/nodes/{node_id}/drain" in s["paths"] and "/readyz" in s["paths"]


def test_object_lookup_parameters_are_not_nullable():
    """A query string has no null. A nullable `key` or `prefix` let schemathesis's fuzzing mutate the
    null branch into an integer or an array whose text is a valid key or an empty prefix, and then
    report the 200 as schema-violating data accepted (a failure seen at random seeds)."""
    from tutti_control.openapi import schema

    params = {p["name"]: p for p in schema()["paths"]["/v1/objects"]["get"]["parameters"]}
    assert set(params) == {"key", "prefix", "limit"}
    for name, p in params.items():
        assert "anyOf" not in p["schema"] and p["schema"]["type"] != "null", (name, p["schema"])
        assert not p.get("required"), name


# -- engines and daemons coming and going ---------------------------------------------------------
def test_pins_come_back_with_a_restarted_engine_and_daemon(tmp_path: Path):
    n = AdminNode(tmp_path, node_id="node-p")
    backend = None
    try:
        keys = [0x6f00 + i for i in range(3)]
        n.store(keys)
        backend = NodeBackend(n.config)
        c = TestClient(create_app(backend, TOKEN))
        assert wait_for(lambda: c.get("/v1/nodes/node-p", headers=AUTH).json()["instances"][0]["engine_connected"])
        assert c.post("/v1/pins", json={"keys": [hexkey(k) for k in keys[:2]]}, headers=AUTH).json()["pinned"]
        assert n.engine_stats()["pinned"] == 2

        # A dead engine cannot act: its units are unreachable (and nothing is recorded as done).
        assert n.engine is not None
        n.engine.kill()
        assert wait_for(lambda: not c.get("/v1/nodes/node-p", headers=AUTH).json()["instances"][0]["engine_connected"], 10)
        assert c.post("/v1/pins", json={"keys": [hexkey(keys[2])]}, headers=AUTH).json()["unreachable"] == [hexkey(keys[2])]
        r = c.delete("/v1/cache", params={"all": "false", "prefix": "0000000000006f"}, headers=AUTH).json()
        assert (r["evicted"], r["pinned_kept"], r["unreachable"]) == (0, 2, 1)
        assert c.get("/v1/objects", params={"prefix": "0000000000006f"}, headers=AUTH).json()["objects"][2]["nodes"]

        # The daemon restarts (pins.json, in the list format of older releases: their tier is any)
        # and a new engine process opens the same pools: the pins are applied to its store as soon
        # as its command channel connects.
        n.daemon.stop(signal.SIGKILL)
        pins_file = Path(n.cfg["data_dir"]) / "pins.json"
        assert json.loads(pins_file.read_text()) == {"any": keys[:2], "memory": []}
        pins_file.write_text(json.dumps(keys[:2]))
        from cluster_fixtures import DaemonProcess

        n.daemon = DaemonProcess(n.cfg, tmp_path / "daemon2.log")
        n.start_engine()
        assert wait_for(lambda: n.engine_stats()["pinned"] == 2, 10), n.engine_stats()
        assert c.get("/v1/pins", headers=AUTH).json()["tiers"] == {hexkey(k): "any" for k in keys[:2]}
    finally:
        if backend is not None:
            backend.close()
        n.close()


def test_drain_stops_new_units_evicts_and_reports(tmp_path: Path):
    n = AdminNode(tmp_path, node_id="node-d")
    backend = NodeBackend(n.config)
    try:
        assert n.engine is not None
        keys = [0x7a00 + i for i in range(4)]
        n.store(keys)
        c = TestClient(create_app(backend, TOKEN))
        assert wait_for(lambda: c.get("/v1/nodes/node-d", headers=AUTH).json()["instances"][0]["engine_connected"])
        c.post("/v1/pins", json={"keys": [hexkey(keys[0])]}, headers=AUTH)

        # Single node: nothing is replicated elsewhere, so "replicated" evicts nothing yet.
        r = c.post("/v1/nodes/node-d/drain", headers=AUTH)
        assert r.status_code == 200
        d = r.json()["drain"]
        assert (d["state"], d["mode"], d["units_left"], d["replicated_elsewhere"]) == ("draining", "replicated", 4, None)
        # No new units: what the engine stores now is removed again; reads keep working.
        n.store([0x7b00])
        assert wait_for(lambda: n.engine.call(op="lookup", keys=[0x7b00])["local"] == 0, 5)
        r = n.engine.call(op="fetch", keys=keys)
        assert r["local"] == 4 and all(r["exact"])
        # No new instances either.
        geometry = json.loads((Path(n.cfg["data_dir"]) / "instances.json").read_text())["engine0"]["geometry"]
        link = DaemonLink(TuttiConfig(**{**n.cfg, "instance": "engine9"}))
        with pytest.raises(CapacityExceeded, match="draining"):
            link.attach_geometry(geometry)
        link.close()

        d = c.post("/v1/nodes/node-d/drain", json={"mode": "all"}, headers=AUTH).json()["drain"]
        assert (d["state"], d["units_left"], d["pinned_left"]) == ("draining", 1, 1)  # the pinned unit stays
        assert n.engine.call(op="lookup", keys=keys)["local"] == 1
        c.request("DELETE", "/v1/pins", json={"keys": [hexkey(keys[0])]}, headers=AUTH)
        drained = wait_for(lambda: c.get("/v1/nodes/node-d", headers=AUTH).json()["drain"]["state"] == "drained", 10)
        assert drained and n.engine.call(op="lookup", keys=keys[:1])["local"] == 0

        d = c.delete("/v1/nodes/node-d/drain", headers=AUTH).json()["drain"]
        assert d["state"] == "serving" and d["mode"] is None
        n.store([0x7c00])
        time.sleep(0.5)
        assert n.engine.call(op="lookup", keys=[0x7c00])["local"] == 1
        is_error(c.delete("/v1/nodes/other/drain", headers=AUTH), 404, "node_not_found")
    finally:
        backend.close()
        n.close()


# -- boundaries -----------------------------------------------------------------------------------
def _imports(path: Path, top_level_only: bool) -> set[str]:
    import ast

    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            out |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    return out


def test_the_admin_plane_reaches_nodes_only_through_the_daemon_and_the_directory():
    # tutti_cluster.files: how the token file is created (owner-only), as every file the node writes;
    # cluster.etcd and cluster.auth: the directory's client credentials.
    allowed = {"tutti_cluster.config", "tutti_cluster.errors", "tutti_cluster.node.link", "tutti_cluster.node.protocol",
               "tutti_cluster.cluster.directory", "tutti_cluster.files", "tutti_cluster.cluster.etcd",
               "tutti_cluster.cluster.auth"}
    for path in sorted((REPO / "control" / "tutti_control").glob("*.py")):
        used = {m for m in _imports(path, top_level_only=False) if m.startswith("tutti_cluster")}
        modules = {m for m in used if m in allowed or m.rsplit(".", 1)[0] not in allowed}
        assert modules <= allowed, (path.name, modules - allowed)
        assert "_native" not in path.read_text() and "TuttiStore" not in path.read_text(), path.name


def test_the_data_plane_never_imports_fastapi():
    import subprocess
    import sys

    for path in sorted((REPO / "tutti_cluster").rglob("*.py")):
        top = _imports(path, top_level_only=True)
        assert not {m for m in top if m.split(".")[0] in ("fastapi", "starlette", "uvicorn", "tutti_control")}, path
    code = ("import sys, tutti_cluster.cli, tutti_cluster.node.daemon, tutti_cluster.node.link, tutti_cluster.cluster.directory; "
            "bad = [m for m in ('fastapi', 'starlette', 'uvicorn', 'tutti_control') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


class Tiered:
    """A node with a memory tier, in this process: its daemon, an engine's store (write_back, a
    memory tier of 10 units) attached through its link, and the admin app under uvicorn."""

    def __init__(self, workdir: Path, mem: Path) -> None:
        from conftest import BLOCK_TOKENS, make_kv
        from tutti_cluster import TuttiStore
        from tutti_cluster.node.daemon import NodeDaemon

        (workdir / "ssd").mkdir()
        self.mem = mem
        base = {"paths": [str(workdir / "ssd")], "unit_tokens": 64, "data_dir": str(workdir / "node"),
                "node_id": "node-m", "memory_paths": [str(mem)]}
        self.cfg = TuttiConfig(**base, capacity_gb=0.05, memory_capacity_gb=0.01)
        self.ecfg = TuttiConfig(**base, capacity_gb=0.004, memory_capacity_gb=0.0002, instance="e0", staging_mb=2)
        self.kv = make_kv(layers=1)
        self.block_tokens = BLOCK_TOKENS
        self.daemon = NodeDaemon(self.cfg).start()
        self.store: Any = None
        self.link: Any = None
        self.open_engine()
        self._url = served_admin(self.cfg)
        self.url = self._url.__enter__()

    def open_engine(self) -> None:
        from tutti_cluster import TuttiStore

        self.store = TuttiStore(self.ecfg)
        self.store.register_kv_caches(self.kv, block_tokens=self.block_tokens)
        self.link = DaemonLink(self.ecfg)
        assert self.link.attach(self.store) is not None

    def close_engine(self) -> None:
        self.link.close()
        self.store.close()

    def put(self, keys: list[int]) -> None:
        """Store ``keys`` (24 at most: the KV holds 24 units) and wait for their flush."""
        assert self.store.store(keys, list(range(len(keys) * self.store.unit_blocks))).units == len(keys)
        assert self.store.flush(timeout_s=30)

    def close(self) -> None:
        self._url.__exit__(None, None, None)
        self.close_engine()
        self.daemon.stop()


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiered]:
    import shutil

    from conftest import shm_dir

    mem = shm_dir()
    try:
        t = Tiered(tmp_path_factory.mktemp("tiered"), mem)
        try:
            yield t
        finally:
            t.close()
    finally:
        shutil.rmtree(mem, ignore_errors=True)


def test_metrics_show_each_tier(tiered: Tiered):
    """An engine with a memory tier (write_back): stores land in memory and are flushed to storage,
    lookups hit in memory; /metrics shows the store's per-tier counters and the memory tier's share."""
    import httpx

    store, cfg, ecfg, mem_dir = tiered.store, tiered.cfg, tiered.ecfg, tiered.mem
    keys = [0x4700 + i for i in range(3)]
    tiered.put(keys)
    assert store.lookup(keys) == len(keys)
    st = store.stats()
    assert st["memory_hits"] >= len(keys) and st["flushes"] >= len(keys) and st["memory_units"] == len(keys)
    inst = (("instance", "e0"), ("node", "node-m"))
    with httpx.Client(base_url=tiered.url, headers=AUTH) as c:
        def scrape() -> dict | None:
            out = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(c.get("/metrics").text) for s in fam.samples}
            # The engine reports its counters on its own schedule: wait for a report made after
            # both the flush and the lookup.
            caught_up = (out.get(("tutti_flushes_total", inst)) == st["flushes"]
                         and out.get(("tutti_tier_hits_total", inst + (("tier", "memory"),))) == st["memory_hits"])
            return out if caught_up else None

        m = wait_for(scrape, 15)
        assert m, "metrics did not catch up with the engine"
        assert m[("tutti_tier_hits_total", inst + (("tier", "memory"),))] == st["memory_hits"]
        assert m[("tutti_tier_hits_total", inst + (("tier", "storage"),))] == st["storage_hits"]
        for name, key in (("tutti_memory_units", "memory_units"), ("tutti_memory_slots", "memory_slots"),
                          ("tutti_memory_free_slots", "memory_free_slots"), ("tutti_flush_bytes_total", "flush_bytes"),
                          ("tutti_flush_errors_total", "flush_errors"), ("tutti_flush_backlog_units", "flush_backlog"),
                          ("tutti_promotions_total", "promotions"), ("tutti_demotions_total", "demotions"),
                          ("tutti_memory_read_bytes_total", "memory_bytes_read")):
            assert m[(name, inst)] == st[key], name
        assert m[("tutti_memory_slots", inst)] > 0 and m[("tutti_flush_bytes_total", inst)] > 0
        assert m[("tutti_instance_memory_capacity_bytes", inst)] == ecfg.memory_capacity_bytes()[0]
        path = (("node", "node-m"), ("path", str(mem_dir)))
        assert m[("tutti_memory_path_capacity_bytes", path)] == cfg.memory_capacity_bytes()[0]
        assert m[("tutti_memory_path_allocated_bytes", path)] == ecfg.memory_capacity_bytes()[0]
        node = c.get("/v1/nodes/node-m").json()
        assert node["memory_paths"] == [str(mem_dir)] and node["instances"][0]["memory_units"] == len(keys)


def test_a_memory_pin_brings_a_unit_into_memory_and_keeps_it_there(tiered: Tiered):
    """POST /v1/pins with tier memory, over uvicorn: a unit on storage only is copied into the memory
    tier and stays there while stores demote everything else; the pin's tier is recorded, listed,
    changed by a second pin, and brought back into a memory tier that a reboot emptied when the
    engine attaches again. Bad tiers are refused. `tutti admin stats` shows each tier."""
    import httpx

    a = 0x4800
    batch = [[a + b * 24 + i for i in range(24)] for b in range(6)]
    tiered.put(batch[0])
    tiered.put(batch[1])  # the memory tier holds 10 units: the first batch is demoted
    assert tiered.store.unit_tiers([a]) == ["storage"]
    pins_file = Path(tiered.cfg.data_dir) / "pins.json"
    with httpx.Client(base_url=tiered.url, headers=AUTH, timeout=30) as c:
        def tier() -> str | None:
            o = c.get("/v1/objects", params={"key": hexkey(a)}).json()["objects"][0]
            return o["tiers"].get("node-m", {}).get("e0")

        assert wait_for(lambda: tier() == "storage", 10)  # the engine's first report shows its memory tier
        for bad in ("hbm", "MEMORY", 1, None):
            err = is_error(c.post("/v1/pins", json={"keys": [hexkey(a)], "tier": bad}), 422, "invalid_request")
            assert err["message"].startswith("invalid request: body.tier: Input should be 'any' or 'memory'"), err
        assert c.get("/v1/pins").json() == {"pins": [], "count": 0, "tiers": {}}

        r = c.post("/v1/pins", json={"keys": [hexkey(a)], "tier": "memory"}).json()
        assert r == {"pinned": [hexkey(a)], "absent": [], "unreachable": [], "no_memory_tier": []}
        assert wait_for(lambda: tier() == "both", 10), tier()
        assert c.get("/v1/pins").json() == {"pins": [hexkey(a)], "count": 1, "tiers": {hexkey(a): "memory"}}
        assert json.loads(pins_file.read_text()) == {"any": [], "memory": [a]}

        # Memory pressure: three more batches, each larger than the memory tier, demote all else.
        demoted = tiered.store.stats()["demotions"]
        for keys in batch[2:5]:
            tiered.put(keys)
        st = tiered.store.stats()
        assert st["demotions"] - demoted > st["memory_slots"]  # every other memory copy made room, more than once
        assert tiered.store.unit_tiers([a]) == ["both"] and tier() == "both"
        assert tiered.store.unit_tiers(batch[1][:1]) == ["storage"]

        # A reboot empties the memory tier; the engine attaches again and gets its memory pin back.
        tiered.close_engine()
        for f in tiered.mem.iterdir():
            f.unlink()
        tiered.open_engine()
        assert tiered.store.unit_tiers([a]) == ["storage"]
        assert wait_for(lambda: tiered.store.unit_tiers([a]) == ["both"], 10)
        assert tiered.store.stats()["pinned"] == 1

        # `tutti admin stats`: the tiers' lines under the usual table.
        want = tiered.store.stats()
        def stats_lines() -> list[str] | None:
            r = subprocess.run([sys.executable, "-m", "tutti_cluster.cli", "admin", "--url", tiered.url, "stats"],
                               capture_output=True, text=True, timeout=60, env={**os.environ, "TUTTI_ADMIN_TOKEN": TOKEN})
            assert r.returncode == 0, r.stderr
            lines = r.stdout.splitlines()
            row = next((ln.split() for ln in lines if ln.startswith("node-m") and "/" in ln.split()[2]), None)
            return lines if row is not None and row[1:4] == [str(want["memory_units"]), "/", str(want["memory_slots"])] else None

        lines = wait_for(stats_lines, 15)
        assert lines, "the tiers' lines did not show the engine's memory tier"
        assert lines[0].split()[:3] == ["NODE", "UNITS", "PINNED"]
        head = lines.index(next(ln for ln in lines if ln.startswith("NODE") and "MEMORY UNITS / SLOTS" in ln))
        assert lines[head].split()[1:] == ["MEMORY", "UNITS", "/", "SLOTS", "MEMORY", "HITS", "STORAGE", "HITS", "READ",
                                           "FROM", "MEMORY", "PROMOTIONS", "DEMOTIONS", "FLUSHES", "FLUSH", "BACKLOG",
                                           "FLUSH", "ERRORS"]
        assert [ln.split()[0] for ln in lines[head + 2:]] == ["node-m", "total"]

        # Pinned again with tier any: recorded so, and the unit stays where it is.
        r = subprocess.run([sys.executable, "-m", "tutti_cluster.cli", "admin", "--url", tiered.url, "pin", hexkey(a)],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "TUTTI_ADMIN_TOKEN": TOKEN})
        assert r.returncode == 0 and r.stdout.splitlines()[2].split() == [hexkey(a), "pinned"], r.stdout
        assert c.get("/v1/pins").json()["tiers"] == {hexkey(a): "any"}
        assert json.loads(pins_file.read_text()) == {"any": [a], "memory": []}
        assert tiered.store.unit_tiers([a]) == ["both"] and tiered.store.stats()["pinned"] == 1
        assert c.request("DELETE", "/v1/pins", json={"keys": [hexkey(a)]}).json()["unpinned"] == [hexkey(a)]

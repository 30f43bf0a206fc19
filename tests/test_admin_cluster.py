"""The cluster-wide admin (`tutti admin serve`'s app) over real etcd and two real nodes, each a
`tutti up` process in cluster mode (daemon, directory lease, Transfer Engine, admin API) with an
engine process attached; the second node fetches the first one's units over the Transfer Engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("fastapi", reason="the admin extra is not installed (pip install '.[admin]')")
from fastapi.testclient import TestClient  # noqa: E402

from admin_fixtures import AUTH, TOKEN, TuttiUp, hexkey, wait_for  # noqa: E402
from cluster_fixtures import (EtcdServer, NodeProcess, close_all, cluster_secret, cluster_secret_file,  # noqa: E402
                              free_port, require_etcd, require_mooncake)
from test_admin import is_error  # noqa: E402
from tutti_cluster import TuttiConfig  # noqa: E402
from tutti_control.app import create_app  # noqa: E402
from tutti_control.cluster import ClusterBackend  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


class ClusterNode:
    def __init__(self, workdir: Path, node_id: str, etcd: str) -> None:
        self.node_id = node_id
        self.up = TuttiUp(workdir / node_id, free_port(), {"TUTTI_ADMIN_TOKEN": TOKEN,
                                                           "TUTTI_CLUSTER_SECRET_FILE": str(cluster_secret_file())},
                          "--etcd", etcd,
                          "--lease-ttl-s", "3", "--node-id", node_id)
        self.engine = NodeProcess(node_id, etcd, workdir / node_id, paths=self.up.paths, capacity_gb=0.02,
                                  with_daemon=False, instance="engine0", data_dir=self.up.data_dir, lease_ttl_s=3)
        assert self.engine.attached

    def close(self) -> None:
        self.engine.close()
        self.up.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[EtcdServer, ClusterNode, ClusterNode]]:
    require_etcd()
    require_mooncake()
    etcd = EtcdServer(tmp_path)
    etcd.start()
    nodes: list[ClusterNode] = []
    try:
        nodes.append(ClusterNode(tmp_path, "node-a", etcd.endpoint))
        nodes.append(ClusterNode(tmp_path, "node-b", etcd.endpoint))
        yield etcd, nodes[0], nodes[1]
    finally:
        close_all(nodes)
        etcd.stop()


def test_cluster_admin_over_the_directory(cluster: tuple[EtcdServer, ClusterNode, ClusterNode]):
    etcd, a, b = cluster
    shared = [0xc100 + i for i in range(4)]
    only_a = 0xc1ff
    assert a.engine.call(op="store", keys=shared + [only_a])["units"] == 5
    # node-b pulls node-a's units over the Transfer Engine and keeps replicas.
    got = wait_for(lambda: (r := b.engine.call(op="fetch", keys=shared, keep=True))["placed"] == 4 and r, 15)
    assert got and all(got["exact"]), got

    backend = ClusterBackend(TuttiConfig(etcd=[etcd.endpoint], admin_token=TOKEN,
                                         cluster_secret_file=cluster_secret_file()), TOKEN)
    c = TestClient(create_app(backend, TOKEN, title="Tutti cluster admin API"))
    try:
        assert c.get("/readyz").json() == {"ready": True, "reasons": [], "checks": {"etcd": True}}
        # A node's own admin API is ready with its daemon and etcd.
        import httpx

        assert httpx.get(f"{a.up.url}/readyz").json()["checks"] == {"daemon": True, "etcd": True}

        nodes = c.get("/v1/nodes", headers=AUTH).json()["nodes"]
        assert [n["node_id"] for n in nodes] == ["node-a", "node-b"]
        assert all(n["reachable"] and n["mode"] == "cluster" and n["admin"] for n in nodes)
        assert nodes[0]["admin"] == a.up.url.removeprefix("http://")
        assert c.get("/v1/nodes/node-b", headers=AUTH).json()["units"] == 4
        is_error(c.get("/v1/nodes/node-z", headers=AUTH), 404, "node_not_found")

        objs = c.get("/v1/objects", params={"prefix": "000000000000c1"}, headers=AUTH).json()["objects"]
        assert [(o["key"], o["nodes"]) for o in objs] == [(hexkey(k), ["node-a", "node-b"]) for k in shared] + \
            [(hexkey(only_a), ["node-a"])]
        by_key = c.get("/v1/objects", params={"key": [hexkey(shared[0]), "dead"]}, headers=AUTH).json()["objects"]
        assert [o["nodes"] for o in by_key] == [["node-a", "node-b"], []]

        stats = c.get("/v1/stats", headers=AUTH).json()
        assert [n["node_id"] for n in stats["nodes"]] == ["node-a", "node-b"]
        assert stats["totals"]["units"] == sum(n["units"] for n in stats["nodes"]) == 9
        assert wait_for(lambda: c.get("/v1/stats", headers=AUTH).json()["nodes"][0]["stage_units"] >= 4, 10)
        cfgs = c.get("/v1/config", headers=AUTH)
        assert set(cfgs.json()["nodes"]) == {"node-a", "node-b"} and TOKEN not in cfgs.text
        assert cfgs.json()["nodes"]["node-a"]["admin_token"] == "<redacted>"

        # The tier goes to every node (neither has a memory tier: the pin protects the unit where it lies).
        r = c.post("/v1/pins", json={"keys": [hexkey(shared[0]), "dead"], "tier": "memory"}, headers=AUTH).json()
        assert r == {"pinned": [hexkey(shared[0])], "absent": [hexkey(0xdead)], "unreachable": [],
                     "no_memory_tier": [hexkey(shared[0])]}
        assert c.get("/v1/pins", headers=AUTH).json() == {"pins": [hexkey(shared[0])], "count": 1,
                                                          "tiers": {hexkey(shared[0]): "memory"}}
        assert all(httpx.get(f"{n.up.url}/v1/pins", headers=AUTH).json()["pins"] == [hexkey(shared[0])] for n in (a, b))

        # Drain node-a: units node-b also holds go at once, except the pinned one; the unit only
        # node-a holds stays readable until another node holds it too.
        d = c.post("/v1/nodes/node-a/drain", headers=AUTH).json()["drain"]
        assert (d["state"], d["mode"], d["units_left"], d["pinned_left"]) == ("draining", "replicated", 2, 1)
        assert d["replicated_elsewhere"] == 1  # of the units left, the pinned one node-b holds too
        assert a.engine.call(op="lookup", keys=[only_a])["local"] == 1
        r = b.engine.call(op="fetch", keys=[only_a], keep=True)
        assert r["placed"] == 1 and all(r["exact"])
        c.request("DELETE", "/v1/pins", json={"keys": [hexkey(shared[0])]}, headers=AUTH)
        assert wait_for(lambda: c.get("/v1/nodes/node-a", headers=AUTH).json()["drain"]["state"] == "drained", 15)
        assert a.engine.call(op="lookup", keys=shared + [only_a])["local"] == 0
        objs = c.get("/v1/objects", params={"prefix": "000000000000c1"}, headers=AUTH).json()["objects"]
        assert all(o["nodes"] == ["node-b"] for o in objs) and len(objs) == 5
        assert all(o["tiers"] == {"node-b": {"engine0": "storage"}} for o in objs)
        assert c.delete("/v1/nodes/node-a/drain", headers=AUTH).json()["drain"]["state"] == "serving"

        r = c.delete("/v1/cache", params={"all": "false", "node": "node-b", "prefix": "000000000000c1"},
                     headers=AUTH).json()
        assert (r["evicted"], r["nodes"]["node-b"]["evicted"]) == (5, 5)
        assert c.get("/v1/objects", params={"prefix": "000000000000c1"}, headers=AUTH).json()["objects"] == []
        is_error(c.delete("/v1/cache", params={"node": "node-z", "all": "true"}, headers=AUTH), 404, "node_not_found")

        # `tutti admin serve` is this app in its own process, as the chart runs it.
        port = free_port()
        serve = subprocess.Popen([sys.executable, "-m", "tutti_cluster.cli", "admin", "serve", "--etcd", etcd.endpoint,
                                  "--admin-port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env={**os.environ, "TUTTI_ADMIN_TOKEN": TOKEN,
                                                 "TUTTI_CLUSTER_SECRET_FILE": str(cluster_secret_file())})
        try:
            assert serve.stdout is not None
            line = serve.stdout.readline()
            assert f"cluster admin API on http://127.0.0.1:{port} (health: http://127.0.0.1:{port + 1}/livez" in line, line
            assert httpx.get(f"http://127.0.0.1:{port}/readyz").json()["ready"]
            assert httpx.get(f"http://127.0.0.1:{port + 1}/readyz").json()["ready"]  # its health listener
            served = httpx.get(f"http://127.0.0.1:{port}/v1/nodes", headers=AUTH).json()["nodes"]
            assert [n["node_id"] for n in served] == ["node-a", "node-b"]
            assert httpx.get(f"http://127.0.0.1:{port}/v1/nodes").status_code == 401
        finally:
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(15) == 0

        # A node that dies is reported, not hidden; once its lease expires it leaves the list.
        b.up.stop(signal.SIGKILL)
        nodes = c.get("/v1/nodes", headers=AUTH).json()["nodes"]
        assert [(n["node_id"], n["reachable"]) for n in nodes] == [("node-a", True), ("node-b", False)]
        is_error(c.get("/v1/pins", headers=AUTH), 503, "node_unavailable")
        is_error(c.get("/v1/nodes/node-b", headers=AUTH), 503, "node_unavailable")
        is_error(c.post("/v1/nodes/node-b/drain", headers=AUTH), 503, "node_unavailable")
        r = c.delete("/v1/cache", params={"all": "true"}, headers=AUTH).json()
        assert r["unreachable_nodes"] == ["node-b"] and list(r["nodes"]) == ["node-a"]
        assert c.post("/v1/pins", json={"keys": ["c100"]}, headers=AUTH).json()["unreachable"] == [hexkey(0xc100)]
        assert c.get("/metrics").text.count('tutti_node_up{node="node-b"} 0.0') == 1
        assert wait_for(lambda: [n["node_id"] for n in c.get("/v1/nodes", headers=AUTH).json()["nodes"]] == ["node-a"], 15)

        etcd.stop()
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["checks"] == {"etcd": False}
        is_error(c.get("/v1/nodes", headers=AUTH), 503, "directory_unavailable")
        t0 = time.monotonic()
        assert httpx.get(f"{a.up.url}/readyz", timeout=10).json()["checks"] == {"daemon": True, "etcd": False}
        assert time.monotonic() - t0 < 5
    finally:
        backend.close()


class _MisbehavingNode:
    """An HTTP server standing in for the admin API of nodes that answer wrongly (a node of another
    version, a broken one, or a record pointing elsewhere): a fault no healthy node can be made to
    show. It answers by the first path segment after /v1/nodes/ or by ``answers[path]``, and
    keeps every request line and Authorization header it saw."""

    def __init__(self, answers: dict[str, tuple[int, object]]) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen = self.seen = []  # type: list[tuple[str, str | None]]

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                seen.append((self.path, self.headers.get("Authorization")))
                status, body = answers.get(self.path, (404, {"error": {"code": "not_found", "message": "no"}}))
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_nodes_that_answer_wrongly_are_unreachable_not_a_broken_cluster_view(tmp_path: Path):
    """Records other nodes wrote into etcd are their word: a node that answers 404, a body of
    another shape, or not JSON, and a record whose admin address is not host:port, each show as
    that node unreachable with the reason; every cluster route stays 200 (one such node used to
    turn /v1/nodes, /v1/stats and /v1/config into 404s or 500s, and a record's address with a path
    got the cluster's token sent there). A node id with '?', ':' or a space is percent-encoded."""
    from tutti_cluster.cluster.directory import NODE_ID_PATTERN, EtcdDirectory, NodeRecord
    from tutti_control.models import NodeId

    assert NodeId.__metadata__[0].pattern == f"^{NODE_ID_PATTERN}$"  # the admin takes every directory id
    require_etcd()
    etcd = EtcdServer(tmp_path)
    etcd.start()
    odd = "gpu:0 a?b#c"
    liar = _MisbehavingNode({"/v1/stats": (200, {"nodes": 5}), "/v1/config": (200, b"not json"),
                             "/v1/nodes/gpu%3A0%20a%3Fb%23c": (200, {"node_id": odd, "mode": "weird"})})
    records = {"says-404": liar.address, "odd-shape": liar.address, odd: liar.address,
               "elsewhere": f"{liar.address}/steal?x=", "userinfo": f"user@{liar.address}", "no-port": "127.0.0.1"}
    dirs = []
    backend = ClusterBackend(TuttiConfig(etcd=[etcd.endpoint], admin_token=TOKEN,
                                         cluster_secret_file=cluster_secret_file()), TOKEN)
    try:
        for node_id, admin in records.items():
            d = EtcdDirectory(etcd.endpoint, node_id, lease_ttl_s=5, secret=cluster_secret())
            d.start(NodeRecord(node_id, "", "", {"admin": admin}))
            dirs.append(d)
        c = TestClient(create_app(backend, TOKEN, title="Tutti cluster admin API"))
        for path in ("/v1/nodes", "/v1/stats", "/v1/config", "/v1/objects?prefix=", "/v1/pins"):
            r = c.get(path, headers=AUTH)
            if path == "/v1/pins":  # a pin list must be whole: unreachable nodes make it a 503
                is_error(r, 503, "node_unavailable")
                continue
            assert r.status_code == 200, (path, r.status_code, r.text)
        nodes = {n["node_id"]: n for n in c.get("/v1/nodes", headers=AUTH).json()["nodes"]}
        assert set(nodes) == set(records) and not any(n["reachable"] for n in nodes.values())
        for node_id in ("elsewhere", "userinfo", "no-port"):
            assert "not host:port" in nodes[node_id]["error"], nodes[node_id]
        assert "refused: 404" in nodes["says-404"]["error"]
        assert "not a NodeInfo" in nodes[odd]["error"]
        stats = {n["node_id"]: n for n in c.get("/v1/stats", headers=AUTH).json()["nodes"]}
        assert not any(n["reachable"] for n in stats.values()) and "not a StatsResponse" in stats["odd-shape"]["error"]
        assert "without JSON" in c.get("/v1/config", headers=AUTH).json()["nodes"]["odd-shape"]["error"]
        is_error(c.get(f"/v1/nodes/{odd.replace('?', '%3F').replace('#', '%23')}", headers=AUTH), 503, "node_unavailable")
        is_error(c.post("/v1/nodes/says-404/drain", headers=AUTH), 404, "not_found")  # the node's own answer
        # The token went to the records' host:port only, and only to /v1 paths.
        assert liar.seen and all(p.startswith("/v1/") and "steal" not in p and a == f"Bearer {TOKEN}"
                                 for p, a in liar.seen), liar.seen
        assert "/v1/nodes/gpu%3A0%20a%3Fb%23c" in [p for p, _ in liar.seen]
    finally:
        backend.close()
        for d in dirs:
            d.stop()
        liar.close()
        etcd.stop()

"""The admin plane under hostile clients, against a real `tutti up` (daemon, admin API and health
listener in one process) over loopback sockets: request metrics whose labels a client cannot
choose, probes answered while the API's connections are held, the schema and its pages behind the
admin token, /metrics behind a scrape token of its own, and a schema that says exactly what
DELETE /v1/cache accepts.
"""

from __future__ import annotations

import json
import os
import random
import resource
import select
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("fastapi", reason="the admin extra is not installed (pip install '.[admin]')")
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from admin_fixtures import TuttiUp  # noqa: E402
from cluster_fixtures import free_port  # noqa: E402
from tutti_cluster import TuttiConfig  # noqa: E402
from tutti_cluster.errors import ConfigError  # noqa: E402
from tutti_control.app import HTTP_METHODS, OTHER  # noqa: E402
from tutti_control.serve import (  # noqa: E402
    HEALTH_HEAD_TIMEOUT_S, HEALTH_MAX_CONNECTIONS, MAX_CONNECTIONS, health_port, metrics_token,
)

REPO = Path(__file__).resolve().parents[1]
ADMIN_TOKEN = "trust-admin-token-0123456789abcdef"
SCRAPE_TOKEN = "trust-scrape-token-fedcba9876543210"
# Connections that never finish their request head: more than the API takes at once.
HELD = 600


def _raise_fd_limit(need: int) -> None:
    """The held connections need a file descriptor each here and in `tutti up` (which inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TuttiUp]:
    """`tutti up` with the admin token from the environment and a scrape token file; docs closed."""
    _raise_fd_limit(4096)
    tmp = tmp_path_factory.mktemp("trust")
    scrape = tmp / "scrape.token"
    scrape.write_text(SCRAPE_TOKEN + "\n")
    scrape.chmod(0o600)
    node = TuttiUp(tmp, free_port(), {"TUTTI_ADMIN_TOKEN": ADMIN_TOKEN}, "--metrics-token-file", str(scrape))
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def open_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TuttiUp]:
    """`tutti up` with no scrape token (open /metrics) and --admin-docs."""
    tmp = tmp_path_factory.mktemp("trust-open")
    node = TuttiUp(tmp, free_port(), {"TUTTI_ADMIN_TOKEN": ADMIN_TOKEN}, "--admin-docs")
    try:
        yield node
    finally:
        node.stop()


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def raw_request(url: str, head: bytes) -> bytes:
    """One request over its own connection (closed by the client's `Connection: close`); the answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def is_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.json()["error"]["code"] == code, r.text


# -- cardinality --------------------------------------------------------------------------------
def test_a_cardinality_attack_leaves_the_series_and_the_daemons_memory_bounded(up: TuttiUp):
    """1,500 requests, each with its own 8 KB method name or its own random path, add no series:
    every label value comes from a closed set, and the daemon's memory does not grow with them."""
    rng = random.Random(43)
    scrape = auth(SCRAPE_TOKEN)
    # Warm up: the allocator's arenas and every label value of ordinary traffic exist before the
    # baseline (what the attack must not add to is what a day of normal requests leaves).
    # Methods of the client's invention reach the app under h11; httptools refuses them itself (400).
    to_app = 0
    for i in range(100):
        answer = raw_request(up.url, f"BREW{i} /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        to_app += answer.startswith(b"HTTP/1.1 405")
        raw_request(up.url, f"GET /nothing-{i} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    httpx.get(f"{up.url}/livez")
    httpx.get(f"{up.url}/metrics", headers=scrape)
    before = rss_bytes(up.proc.pid)
    answered = 0
    for i in range(1500):
        if i % 2:
            method = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(8192))
            head = f"{method} /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        else:
            path = "/v1/" + "".join(rng.choice("abcdef0123456789") for _ in range(2000))
            head = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        answer = raw_request(up.url, head.encode())
        answered += answer.startswith(b"HTTP/1.1 ")
        to_app += answer.startswith(b"HTTP/1.1 405")
    assert answered == 1500  # the attack reached the server: every request was answered
    after = rss_bytes(up.proc.pid)

    r = httpx.get(f"{up.url}/metrics", headers=scrape)
    assert r.status_code == 200
    assert len(r.content) < 256 * 1024, len(r.content)
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = [s for s in families["tutti_admin_requests"].samples if s.name == "tutti_admin_requests_total"]
    assert len(samples) <= 40, len(samples)
    schema_paths = set(json.loads((REPO / "docs" / "openapi.json").read_text())["paths"])
    for s in samples:
        assert s.labels["method"] in HTTP_METHODS | {OTHER}, s.labels
        assert s.labels["route"] in schema_paths | {"/openapi.json", "/docs", "/redoc", OTHER}, s.labels
    # The attack's requests that reached the app are counted, as `other`.
    assert sum(s.value for s in samples if s.labels["method"] == OTHER) >= to_app
    assert sum(s.value for s in samples if s.labels["route"] == OTHER) >= 750 + 100
    assert after - before < 20 << 20, f"RSS grew by {(after - before) / (1 << 20):.1f} MiB"


# -- probes while the API's connections are held ------------------------------------------------
class Holder:
    """Keeps ``n`` connections to ``url`` that never finish their request head, reopening each one
    the server closes (as an attacker would), until stopped."""

    def __init__(self, url: str, n: int) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.addr = (host, int(port))
        self.n = n
        self.socks: list[socket.socket] = []
        self.reopened = 0
        self.stop = threading.Event()
        for _ in range(n):
            self.socks.append(self._open())
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> socket.socket:
        s = socket.create_connection(self.addr, timeout=5)
        try:
            s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        except OSError:
            pass  # closed at once (past the server's limit): reopened below like the others
        return s

    def _run(self) -> None:
        while not self.stop.wait(0.05):  # at most 20 rounds of reopening a second
            poller = select.poll()
            by_fd = {s.fileno(): s for s in self.socks}
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(100):  # readable: closed by the server (EOF or reset)
                s = by_fd[fd]
                self.socks.remove(s)
                s.close()
                if not self.stop.is_set():
                    try:
                        self.socks.append(self._open())
                        self.reopened += 1
                    except OSError:
                        pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            s.close()
        self.socks.clear()


def test_probes_answer_on_the_health_listener_while_the_apis_connections_are_held(up: TuttiUp):
    assert up.health_url is not None, up.lines
    assert HELD > MAX_CONNECTIONS
    holder = Holder(up.url, HELD)
    try:
        # The API is full: a request on a new connection is closed or refused, not answered 200.
        try:
            answer = raw_request(up.url, b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        except OSError:
            answer = b""
        assert not answer.startswith(b"HTTP/1.1 200"), answer[:100]
        # Probes on the health listener, the way a kubelet sends them: a new connection each.
        answers = []
        for _ in range(30):
            for path in ("/livez", "/readyz"):
                r = httpx.get(f"{up.health_url}{path}", timeout=5, headers={"Connection": "close"})
                answers.append((path, r.status_code))
            time.sleep(0.1)
        assert answers == [(p, 200) for _ in range(30) for p in ("/livez", "/readyz")], answers
        assert len(holder.socks) >= MAX_CONNECTIONS  # the attack held its connections throughout
    finally:
        holder.close()
    assert serves(f"{up.url}/livez")  # once the attacker is gone, the API serves again


def serves(url: str, within_s: float = 20.0) -> bool:
    """GET ``url`` answers 200 within ``within_s`` (retried while the server drops closed connections)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def test_the_health_listener_serves_probes_only(up: TuttiUp):
    assert up.health_url is not None
    assert httpx.get(f"{up.health_url}/livez").json() == {"status": "ok"}
    r = httpx.get(f"{up.health_url}/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True
    for path in ("/metrics", "/v1/nodes", "/docs", "/openapi.json", "/redoc"):
        for headers in ({}, auth(ADMIN_TOKEN), auth(SCRAPE_TOKEN)):
            is_error(httpx.get(f"{up.health_url}{path}", headers=headers), 404, "not_found")
    is_error(httpx.post(f"{up.health_url}/livez"), 405, "method_not_allowed")
    # Its own limits: connections past HEALTH_MAX_CONNECTIONS are closed at once, the others when
    # their request head is not whole within HEALTH_HEAD_TIMEOUT_S.
    host, port = up.health_url.removeprefix("http://").rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(HEALTH_MAX_CONNECTIONS + 8)]
    try:
        for s in socks:
            try:
                s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                pass
        assert wait_closed(socks, 8, HEALTH_HEAD_TIMEOUT_S / 2)
        assert wait_closed(socks, len(socks), HEALTH_HEAD_TIMEOUT_S + 10)
    finally:
        for s in socks:
            s.close()
    assert serves(f"{up.health_url}/livez")


def wait_closed(socks: list[socket.socket], n: int, within_s: float) -> bool:
    """At least ``n`` of ``socks`` are closed by the server within ``within_s``."""
    deadline = time.monotonic() + within_s
    closed: set[int] = set()
    while len(closed) < n and time.monotonic() < deadline:
        poller = select.poll()
        for i, s in enumerate(socks):
            if i not in closed:
                poller.register(s.fileno(), select.POLLIN)
        fds = {fd for fd, _ in poller.poll(50)}
        closed |= {i for i, s in enumerate(socks) if s.fileno() in fds}
    return len(closed) >= n


def test_the_health_port_is_next_to_the_admin_port_unless_set(tmp_path: Path):
    assert health_port(TuttiConfig(admin_port=9480)) == 9481
    assert health_port(TuttiConfig(admin_port=0)) == 0
    assert health_port(TuttiConfig(admin_port=9480, health_port=0)) == 0
    assert health_port(TuttiConfig(admin_port=0, health_port=7000)) == 7000
    with pytest.raises(ConfigError, match="health_port"):
        health_port(TuttiConfig(admin_port=65535))


def test_tutti_up_refuses_a_health_port_it_cannot_bind(tmp_path: Path):
    import subprocess
    import sys

    port = free_port()
    r = subprocess.run([sys.executable, "-m", "tutti_cluster.cli", "up", "--data-dir", str(tmp_path / "node"),
                        "--paths", str(tmp_path), "--capacity-gb", "0.01", "--admin-host", "127.0.0.1",
                        "--admin-port", str(port), "--health-port", str(port)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.startswith("tutti: error:")]
    assert len(lines) == 1 and "health listener" in lines[0] and f":{port}" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


# -- the schema and its pages -------------------------------------------------------------------
def test_the_schema_and_its_pages_need_the_admin_token(up: TuttiUp):
    for path in ("/openapi.json", "/docs", "/redoc"):
        for headers in ({}, auth("wrong"), auth(SCRAPE_TOKEN), {"Authorization": f"Basic {ADMIN_TOKEN}"}):
            r = httpx.get(f"{up.url}{path}", headers=headers)
            is_error(r, 401, "unauthorized")
            assert r.headers["www-authenticate"].startswith("Bearer")
        r = httpx.get(f"{up.url}{path}", headers=auth(ADMIN_TOKEN))
        assert r.status_code == 200, (path, r.status_code)
    served = httpx.get(f"{up.url}/openapi.json", headers=auth(ADMIN_TOKEN)).json()
    committed = json.loads((REPO / "docs" / "openapi.json").read_text())
    # With a scrape token, the served schema says /metrics needs it; the rest is the committed one.
    assert "401" in served["paths"]["/metrics"]["get"]["responses"]
    served["paths"].pop("/metrics"), committed["paths"].pop("/metrics")
    assert served == committed


def test_admin_docs_opens_the_schema_and_its_pages(open_up: TuttiUp):
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{open_up.url}{path}").status_code == 200, path
    assert httpx.get(f"{open_up.url}/openapi.json").json() == json.loads((REPO / "docs" / "openapi.json").read_text())
    is_error(httpx.get(f"{open_up.url}/v1/nodes"), 401, "unauthorized")  # the API itself stays closed


# -- the scrape token ----------------------------------------------------------------------------
def test_metrics_need_the_scrape_token_where_one_is_set(up: TuttiUp, tmp_path: Path):
    for headers in ({}, auth("wrong"), auth(ADMIN_TOKEN), {"Authorization": f"Basic {SCRAPE_TOKEN}"}):
        r = httpx.get(f"{up.url}/metrics", headers=headers)
        is_error(r, 401, "unauthorized")
        assert r.headers["www-authenticate"].startswith("Bearer")
    r = httpx.get(f"{up.url}/metrics", headers=auth(SCRAPE_TOKEN))
    assert r.status_code == 200 and 'tutti_node_up{node="cli-node"} 1.0' in r.text
    # Rotation: a new token renamed into place takes effect at the next scrape, the old one ends.
    scrape = up.data_dir.parent / "scrape.token"
    new = scrape.with_name("scrape.token.new")
    new.write_text("rotated-scrape-token-0123456789\n")
    new.chmod(0o600)
    os.replace(new, scrape)
    try:
        is_error(httpx.get(f"{up.url}/metrics", headers=auth(SCRAPE_TOKEN)), 401, "unauthorized")
        assert httpx.get(f"{up.url}/metrics", headers=auth("rotated-scrape-token-0123456789")).status_code == 200
        # A token file that is gone or empty refuses every scrape (never opens /metrics).
        scrape.write_text("")
        assert httpx.get(f"{up.url}/metrics").status_code == 401
        assert httpx.get(f"{up.url}/metrics", headers=auth("rotated-scrape-token-0123456789")).status_code == 401
    finally:
        scrape.write_text(SCRAPE_TOKEN + "\n")
    assert httpx.get(f"{up.url}/metrics", headers=auth(SCRAPE_TOKEN)).status_code == 200
    # Liveness and readiness never need a token.
    assert httpx.get(f"{up.url}/livez").status_code == 200 and httpx.get(f"{up.url}/readyz").status_code == 200


def test_metrics_are_open_without_a_scrape_token(open_up: TuttiUp):
    r = httpx.get(f"{open_up.url}/metrics")
    assert r.status_code == 200 and 'tutti_node_up{node="cli-node"} 1.0' in r.text


def test_a_scrape_token_file_that_is_no_token_is_one_config_error(tmp_path: Path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    shared = tmp_path / "shared"
    shared.write_text(SCRAPE_TOKEN)
    for path in (big, empty, shared):
        path.chmod(0o600)
    shared.chmod(0o640)
    for path, what in ((fifo, "not a regular file"), (big, "larger than"), (empty, "empty"),
                       (tmp_path / "missing", "cannot read"), (tmp_path, "not a regular file"),
                       (shared, "mode 0640.*owner-only")):
        with pytest.raises(ConfigError, match=what):  # at once: a FIFO never blocks the start
            metrics_token(TuttiConfig(metrics_token_file=path))


# -- the schema says what DELETE /v1/cache accepts ----------------------------------------------
def test_evict_requires_an_explicit_selector_in_the_schema_and_on_the_wire(up: TuttiUp):
    schema = httpx.get(f"{up.url}/openapi.json", headers=auth(ADMIN_TOKEN)).json()
    params = {p["name"]: p for p in schema["paths"]["/v1/cache"]["delete"]["parameters"]}
    assert params["all"]["required"] is True and "default" not in params["all"]["schema"]
    assert not params["prefix"]["required"] and not params["node"]["required"]
    admin = auth(ADMIN_TOKEN)
    # What the schema refuses, the server refuses (422); what it accepts, the server does (200).
    is_error(httpx.delete(f"{up.url}/v1/cache", headers=admin), 422, "invalid_request")
    is_error(httpx.delete(f"{up.url}/v1/cache", params={"prefix": "00ab"}, headers=admin), 422, "invalid_request")
    is_error(httpx.delete(f"{up.url}/v1/cache", params={"node": "cli-node"}, headers=admin), 422, "invalid_request")
    r = httpx.delete(f"{up.url}/v1/cache", params={"all": "false"}, headers=admin)
    assert r.status_code == 200 and r.json()["evicted"] == 0
    for params_ in ({"all": "false", "prefix": "00ab"}, {"all": "false", "node": "cli-node"}, {"all": "true"}):
        assert httpx.delete(f"{up.url}/v1/cache", params=params_, headers=admin).status_code == 200, params_

"""Running the admin app under uvicorn: beside the node daemon in `tutti up`, or cluster-wide
(`tutti admin serve`).

``tutti_cluster.cli`` imports this module only when it serves the admin plane, so that the data
plane never imports FastAPI.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from tutti_cluster.config import TuttiConfig
from tutti_cluster.errors import ConfigError

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """The admin API's listening socket, bound now (so the address is known before serving)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as exc:
        s.close()
        raise ConfigError(f"admin API cannot listen on {host}:{port}: {exc}") from exc
    s.listen(2048)
    s.setblocking(False)
    return s


def address_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# Limits uvicorn does not set by itself: a request head (request line and headers) must arrive
# within HEAD_TIMEOUT_S of the connection, or of the last response on it; at most MAX_CONNECTIONS
# are open at once, a connection past them is closed at once. Without them, clients that open
# connections and send nothing whole held a file descriptor each for ever, until the process (the
# node daemon, in `tutti up`) could open no pool file and save no state.
HEAD_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 512


def guarded_http_protocol() -> type:
    """The HTTP protocol uvicorn would pick (httptools where installed, else h11) with the two
    limits above. ``connection_made``, ``on_response_complete``, ``cycle`` (a new one per request
    head), ``connections`` and ``loop`` are both protocols' own, the same since before uvicorn
    0.29; tests/test_admin.py holds the limits to them."""
    base: type
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class GuardedHttpProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > MAX_CONNECTIONS:
                transport.close()
                return
            self._head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._head_deadline()

        def _head_deadline(self) -> None:
            waiting_after = self.cycle

            def expire() -> None:
                if self.cycle is waiting_after and not self.transport.is_closing():
                    self.transport.close()

            self.loop.call_later(HEAD_TIMEOUT_S, expire)

    return GuardedHttpProtocol


class AdminServer:
    """uvicorn serving one admin app on a bound socket, in a thread of this process."""

    def __init__(self, app: Any, sock: socket.socket, backend: Any = None) -> None:
        import uvicorn

        self.sock = sock
        self.backend = backend
        self.address = address_of(sock)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=5, backlog=2048,
                                                    http=guarded_http_protocol()))
        self.thread: threading.Thread | None = None

    def start(self, timeout_s: float = 15.0) -> "AdminServer":
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="tutti-admin", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"admin API did not start on {self.address}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(10)
        self.sock.close()
        if self.backend is not None:
            self.backend.close()


def node_admin(config: TuttiConfig, sock: socket.socket) -> tuple[AdminServer, str, Path | None, bool]:
    """The node's admin API over its daemon's socket, not yet started: (server, token, token
    file, whether the file was just made)."""
    from tutti_control.app import create_app
    from tutti_control.auth import ensure_token
    from tutti_control.backend import NodeBackend

    token, path, created = ensure_token(config)
    backend = NodeBackend(config)
    return AdminServer(create_app(backend, token), sock, backend), token, path, created


def cluster_admin(config: TuttiConfig, sock: socket.socket) -> tuple[AdminServer, str]:
    """The cluster-wide admin API: the nodes come from the cluster directory (etcd)."""
    from tutti_control.app import create_app
    from tutti_control.auth import configured_token
    from tutti_control.cluster import ClusterBackend

    if not config.etcd:
        raise ConfigError("tutti admin serve needs the cluster directory: set --etcd or TUTTI_ETCD")
    token = configured_token(config)
    if token is None:
        raise ConfigError("tutti admin serve needs the nodes' admin token: TUTTI_ADMIN_TOKEN or TUTTI_ADMIN_TOKEN_FILE")
    backend = ClusterBackend(config, token)
    return AdminServer(create_app(backend, token, title="Tutti cluster admin API"), sock, backend), token


class NodeAdmin:
    """The node's admin API inside `tutti up`: bound at once (the address goes into the node's
    cluster record), started once the daemon serves, stopped after it."""

    def __init__(self, config: TuttiConfig) -> None:
        # ImportError here, before anything is bound, where the admin extra is not installed.
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401

        self.config = config
        self.token_note = ""
        self.sock = bind(config.admin_host, config.admin_port)
        self.address = address_of(self.sock)
        self.advertised = self._advertised()
        self.server: AdminServer | None = None

    def _advertised(self) -> str:
        """What other nodes and the cluster-wide admin dial: a wildcard listen address is replaced
        by this host's address on the route to etcd."""
        host, port = self.sock.getsockname()[:2]
        if host in ("0.0.0.0", "::") and (self.config.etcd or self.config.advertise_host):
            from tutti_cluster.cluster.directory import advertised_host

            host = advertised_host(self.config)  # advertise_host when set, as the daemon advertises
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> None:
        """Serve; the token (made now on first start) is read once the daemon serves, so that a
        data directory the daemon cannot use is reported by the daemon first."""
        from tutti_control.app import create_app
        from tutti_control.auth import ensure_token
        from tutti_control.backend import NodeBackend

        token, path, created = ensure_token(self.config)
        if self.config.admin_token is not None and self.config.admin_token.get_secret_value():
            self.token_note = "from TUTTI_ADMIN_TOKEN"
        elif created:
            self.token_note = f"created in {path} (mode 0600)"
        else:
            self.token_note = f"in {path}"
        backend = NodeBackend(self.config)
        self.server = AdminServer(create_app(backend, token), self.sock, backend).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        else:
            self.sock.close()

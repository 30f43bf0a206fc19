"""Running the admin app under uvicorn: beside the node daemon in `tutti up`, or cluster-wide
(`tutti admin serve`); each with a health listener of its own (``GET /livez`` and ``/readyz`` on
``health_port``, in another thread with its own connection limit), so that probes are answered
however many connections the API holds.

``tutti_cluster.cli`` imports this module only when it serves the admin plane, so that the data
plane never imports FastAPI.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import weakref
from typing import Any

from tutti_cluster.config import TuttiConfig
from tutti_cluster.errors import ConfigError

log = logging.getLogger(__name__)


def bind(host: str, port: int, what: str = "admin API", backlog: int = 2048) -> socket.socket:
    """A listening socket, bound now (so the address is known before serving)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as exc:
        s.close()
        raise ConfigError(f"{what} cannot listen on {host}:{port}: {exc}") from exc
    s.listen(backlog)
    s.setblocking(False)
    return s


def health_port(config: TuttiConfig) -> int:
    """The health listener's port: ``health_port``, else the admin port + 1 (0, any free port, where
    the admin port is 0)."""
    if config.health_port is not None:
        return config.health_port
    if config.admin_port == 0:
        return 0
    if config.admin_port >= 65535:
        raise ConfigError("admin_port 65535 leaves no port for the health listener: set health_port")
    return config.admin_port + 1


def bind_health(config: TuttiConfig) -> socket.socket:
    """The health listener's socket, on ``admin_host`` like the API."""
    return bind(config.admin_host, health_port(config), "admin health listener (health_port)", backlog=HEALTH_BACKLOG)


def address_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# Limits uvicorn does not set by itself: a request head (request line and headers) must arrive
# within HEAD_TIMEOUT_S of the connection, or of the last response on it; at most MAX_CONNECTIONS
# are open at once, a connection past them is closed at once. Without them, clients that open
# connections and send nothing whole held a file descriptor each for ever, until the process (the
# node daemon, in `tutti up`) could open no pool file and save no state. uvicorn's own
# limit_concurrency (MAX_CONNECTIONS: requests past it are answered 503 at once) and keep-alive
# timeout (KEEP_ALIVE_S) are set too.
HEAD_TIMEOUT_S = 5.0
KEEP_ALIVE_S = 5
MAX_CONNECTIONS = 512
# The health listener's: probes are one short request per connection.
HEALTH_HEAD_TIMEOUT_S = 2.0
HEALTH_MAX_CONNECTIONS = 32
HEALTH_BACKLOG = 64


def guarded_http_protocol(max_connections: int | None = None, head_timeout_s: float | None = None) -> type:
    """The HTTP protocol uvicorn would pick (httptools where installed, else h11) with the two
    limits above (MAX_CONNECTIONS and HEAD_TIMEOUT_S unless given). ``connection_made``,
    ``on_response_complete``, ``cycle`` (a new one per request head), ``connections`` (the
    server's) and ``loop`` are both protocols' own, the same since before uvicorn 0.29;
    tests/test_admin.py holds the limits to them."""
    limit = MAX_CONNECTIONS if max_connections is None else max_connections
    timeout_s = HEAD_TIMEOUT_S if head_timeout_s is None else head_timeout_s
    base: type
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class GuardedHttpProtocol(base):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limit:
                transport.close()
                return
            self._head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            # The timer would keep this connection's objects (its last request among them) alive
            # until it fires: at a thousand requests a second, megabytes that the process keeps.
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._head_deadline()

        def _head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            # A new request head makes a new cycle: the deadline holds while the cycle is this one
            # (by weak reference, so that the old request is not kept for the deadline's sake).
            waiting_after = weakref.ref(self.cycle) if self.cycle is not None else None

            def expire() -> None:
                self._head_timer = None
                unchanged = self.cycle is None if waiting_after is None else waiting_after() is self.cycle
                if unchanged and not self.transport.is_closing():
                    self.transport.close()

            self._head_timer = self.loop.call_later(timeout_s, expire)

    return GuardedHttpProtocol


class AdminServer:
    """uvicorn serving one admin app on a bound socket, in a thread of this process (``health``:
    the health listener's limits)."""

    def __init__(self, app: Any, sock: socket.socket, backend: Any = None, *, health: bool = False) -> None:
        import uvicorn

        self.sock = sock
        self.backend = backend
        self.address = address_of(sock)
        self.name = "tutti-admin-health" if health else "tutti-admin"
        if health:
            limit, head_s, keep_alive_s, backlog = (HEALTH_MAX_CONNECTIONS, HEALTH_HEAD_TIMEOUT_S,
                                                    int(HEALTH_HEAD_TIMEOUT_S), HEALTH_BACKLOG)
        else:
            limit, head_s, keep_alive_s, backlog = MAX_CONNECTIONS, HEAD_TIMEOUT_S, KEEP_ALIVE_S, 2048
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=5, backlog=backlog,
                                                    limit_concurrency=limit, timeout_keep_alive=keep_alive_s,
                                                    http=guarded_http_protocol(limit, head_s)))
        self.thread: threading.Thread | None = None

    def start(self, timeout_s: float = 15.0) -> "AdminServer":
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=self.name, daemon=True)
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


def metrics_token(config: TuttiConfig) -> Any:
    """The scrape token of ``/metrics`` (a TokenFile), or None where /metrics is open. A file that
    cannot be read or holds no token is a ConfigError now, before anything serves."""
    from tutti_control.auth import TokenFile

    if config.metrics_token_file is None:
        return None
    return TokenFile(config.metrics_token_file, "scrape token (metrics_token_file)")


def health_server(backend: Any, sock: socket.socket, own_backend: bool) -> AdminServer:
    """The health listener over ``backend`` (closed with the listener where ``own_backend``)."""
    from tutti_control.app import create_health_app

    return AdminServer(create_health_app(backend), sock, backend if own_backend else None, health=True)


def cluster_admin(config: TuttiConfig, sock: socket.socket,
                  health_sock: socket.socket | None = None) -> tuple[AdminServer, str, AdminServer | None]:
    """The cluster-wide admin API: the nodes come from the cluster directory (etcd). With
    ``health_sock``, its health listener too (over the same backend: readiness is an etcd read)."""
    from tutti_control.app import create_app
    from tutti_control.auth import configured_token
    from tutti_control.cluster import ClusterBackend

    if not config.etcd:
        raise ConfigError("tutti admin serve needs the cluster directory: set --etcd or TUTTI_ETCD")
    token = configured_token(config)
    if token is None:
        raise ConfigError("tutti admin serve needs the nodes' admin token: TUTTI_ADMIN_TOKEN or TUTTI_ADMIN_TOKEN_FILE")
    scrape = metrics_token(config)
    backend = ClusterBackend(config, token)
    app = create_app(backend, token, title="Tutti cluster admin API", open_docs=config.admin_docs,
                     metrics_token=scrape)
    health = health_server(backend, health_sock, own_backend=False) if health_sock is not None else None
    return AdminServer(app, sock, backend), token, health


class NodeAdmin:
    """The node's admin API inside `tutti up`: bound at once (the address goes into the node's
    cluster record), started once the daemon serves, stopped after it."""

    def __init__(self, config: TuttiConfig) -> None:
        # ImportError here, before anything is bound, where the admin extra is not installed.
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401

        self.config = config
        self.token_note = ""
        self.scrape_token = metrics_token(config)
        self.sock = bind(config.admin_host, config.admin_port)
        try:
            self.health_sock = bind_health(config)
        except ConfigError:
            self.sock.close()
            raise
        self.address = address_of(self.sock)
        self.health_address = address_of(self.health_sock)
        self.advertised = self._advertised()
        self.server: AdminServer | None = None
        self.health: AdminServer | None = None

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
        # The health listener first, with daemon connections of its own: probes never wait for a
        # connection the API's requests hold.
        self.health = health_server(NodeBackend(self.config, pool_size=2), self.health_sock, own_backend=True).start()
        backend = NodeBackend(self.config)
        app = create_app(backend, token, open_docs=self.config.admin_docs, metrics_token=self.scrape_token)
        self.server = AdminServer(app, self.sock, backend).start()

    def stop(self) -> None:
        for server, sock in ((self.server, self.sock), (self.health, self.health_sock)):
            if server is not None:
                server.stop()
            else:
                sock.close()

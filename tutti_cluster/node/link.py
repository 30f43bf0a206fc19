"""The engine side of the node daemon's socket (:class:`DaemonLink`); the admin plane uses it too.

It imports the protocol only, never the daemon: an engine process loads no server code.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import random
import socket
import threading
import time
from typing import Any, Callable, TypeVar

from pydantic import ValidationError

from tutti_cluster.config import TuttiConfig
from tutti_cluster.errors import NotFound, TuttiError
from tutti_cluster.node.protocol import (ADMIN_TIMEOUT_S, COMMAND_WAIT_MS, LINK_TIMEOUT_S, MAX_LINE, AttachRequest,
                                         Command, CommandResult, CommandsReply, CommandsRequest, CommitRequest,
                                         ErrorReply, EvictRequest, Reply, Request, geometry_of, make_request,
                                         socket_path)

log = logging.getLogger(__name__)

_P = TypeVar("_P", bound=Reply)
# The notifications a store's callbacks queue, by op.
_NOTIFICATIONS: dict[str, type[CommitRequest] | type[EvictRequest]] = {"commit": CommitRequest, "evict": EvictRequest}


class DaemonLink:
    """Engine side of the daemon socket: attach, then best-effort commit/evict notifications.

    ``attach()`` is synchronous (the reply within ``attach_timeout_s``: the daemon opens the pools
    first) and raises the daemon's TuttiError subclass if it refuses; when no daemon runs it returns
    None and the engine works alone. Connecting retries with exponential backoff for up to
    ``connect_retry_s`` while the daemon's listen queue is full (a node's engines all starting at
    once). Notifications are queued and sent by a background thread, so ``store.on_commit`` never
    waits on the daemon; when the daemon is away they are dropped, and the next successful
    (re)attach makes the daemon rescan this instance's headers.
    """

    def __init__(self, config: TuttiConfig, timeout_s: float = LINK_TIMEOUT_S, max_queue: int = 1 << 16,
                 attach_timeout_s: float = 10.0, connect_retry_s: float = 4.0) -> None:
        self.config = config
        self.path = str(socket_path(config))
        self.timeout_s = timeout_s
        self.attach_timeout_s = attach_timeout_s
        self.connect_retry_s = connect_retry_s
        self.connect_retries = 0
        self.max_queue = max_queue
        self._sock: socket.socket | None = None
        self._rfile: Any = None
        self._lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: list[tuple[str, int]] = []
        self._geometry: dict[str, Any] | None = None
        self._stop = False
        self._inflight = 0
        self._overflow = False
        self.dropped = 0
        # Admin commands (pin, unpin, remove, drain) for the attached store, taken on a second
        # connection that waits in the daemon (``commands``) and carries the store's counters.
        self._store: Any = None
        self._pinned: set[int] = set()
        self.draining = False
        self.cluster_stats: Callable[[], dict[str, Any]] | None = None  # e.g. a ClusterClient's stats
        # Counters added to the store's own in what the daemon shows (e.g. the vLLM connector's
        # lookups and hits, which it counts above the store: its lookups never reach the store).
        self.extra_stats: Callable[[], dict[str, int]] | None = None
        self.commands_applied = 0
        self.pending = False  # an attach the daemon did not confirm in time: it may still take it
        self._closed = threading.Event()
        self._cmd_sock: socket.socket | None = None
        self._cmd_thread: threading.Thread | None = None
        self._thread = threading.Thread(target=self._sender, name="tutti-daemon-link", daemon=True)
        self._thread.start()

    def _connect(self) -> None:
        # A full listen queue refuses a unix-socket connect at once (EAGAIN) rather than queueing
        # it: back off and retry, with jitter so that a crowd does not come back in step. No
        # socket file or a refused connection means no daemon: the caller works alone at once.
        deadline = time.monotonic() + self.connect_retry_s
        delay = 0.005
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout_s)
            try:
                s.connect(self.path)
            except OSError as exc:
                s.close()
                busy = exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR) or isinstance(exc, TimeoutError)
                pause = delay * random.uniform(0.5, 1.0)
                if not busy or time.monotonic() + pause > deadline:
                    raise
                self.connect_retries += 1
                time.sleep(pause)
                delay = min(delay * 2, 0.25)
                continue
            self._sock, self._rfile = s, s.makefile("rb")
            return

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = self._rfile = None

    def request(self, msg: dict[str, Any] | Request, timeout_s: float | None = None) -> dict[str, Any]:
        """Send one request and wait for its reply (within ``timeout_s``, default ``self.timeout_s``).

        Raises OSError when the daemon is unreachable, and the daemon's own TuttiError subclass
        (ConfigError, NotFound, CapacityExceeded, LayoutError, StorageError, ...) when it refuses."""
        data = msg.model_dump_json() if isinstance(msg, Request) else json.dumps(msg)
        with self._lock:
            try:
                if self._sock is None:
                    self._connect()
                assert self._sock is not None
                self._sock.settimeout(self.timeout_s if timeout_s is None else timeout_s)
                self._sock.sendall(data.encode() + b"\n")
                line = self._rfile.readline(MAX_LINE)
                if not line:
                    raise ConnectionResetError("daemon closed the connection")
            except (OSError, ValueError):
                self._drop()
                raise
        reply = dict(json.loads(line))
        if reply.get("ok") is not True:
            try:
                err = ErrorReply.model_validate(reply)
            except ValidationError:
                raise TuttiError(f"node daemon: unexpected reply {line[:200]!r}") from None
            raise err.exception()
        return reply

    def ask(self, req: Request, reply: type[_P], timeout_s: float | None = None) -> _P:
        """:meth:`request` with its reply read as ``reply`` (pydantic's ValidationError, a ValueError,
        when it is not one)."""
        return reply.model_validate(self.request(req, timeout_s))

    def attach(self, store: Any) -> dict[str, Any] | None:
        """Announce ``store`` and hook its commit/evict callbacks. None when no daemon answers."""
        geometry = geometry_of(store)
        store.on_commit = lambda k: self._enqueue("commit", k)
        store.on_evict = lambda k: self._enqueue("evict", k)
        self._store = store
        return self.attach_geometry(geometry)

    def attach_geometry(self, geometry: dict[str, Any]) -> dict[str, Any] | None:
        """Announce this instance's pools by their geometry (see :func:`geometry_of`); what
        :meth:`attach` does without touching a store's callbacks."""
        self._geometry = geometry
        return self._attach()

    def _attach(self) -> dict[str, Any] | None:
        if self._closed.is_set():
            return None
        try:
            req = make_request(AttachRequest, instance=self.config.instance, geometry=self._geometry,
                               capacity=self.config.capacity_bytes(),
                               memory_capacity=self.config.memory_capacity_bytes() or None)
            reply = self.request(req, timeout_s=self.attach_timeout_s)
        except TimeoutError as exc:
            # A daemon busy with many attaches finishes ours on its own; the command channel then
            # finds us attached (or attaches again).
            log.warning("node daemon at %s did not confirm the attach within %s s (%s); the store works "
                        "alone until it does", self.path, self.attach_timeout_s, exc)
            self.pending = True
            self._start_commands()
            return None
        except OSError as exc:
            log.info("no node daemon at %s (%s); the store works alone", self.path, exc)
            return None
        self.pending = False
        self._start_commands()
        return reply

    def _start_commands(self) -> None:
        """The command channel of an attached store, once a daemon took (or is taking) its attach."""
        with self._cv:
            if self._store is None or self._cmd_thread is not None or self._stop:
                return
            t = self._cmd_thread = threading.Thread(target=self._command_loop, name="tutti-daemon-commands",
                                                    daemon=True)
        t.start()

    def _enqueue(self, op: str, key: int) -> None:
        with self._cv:
            if len(self._queue) >= self.max_queue:
                self.dropped += 1
                self._overflow = True  # the daemon must rescan us: re-attach once it keeps up
                return
            self._queue.append((op, key))
            self._cv.notify()

    def _sender(self) -> None:
        need_attach = False
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue) or self._stop, timeout=1.0)
                if self._stop and not self._queue:
                    return
                batch, self._queue = self._queue, []
                self._inflight = len(batch)
                # A draining node takes no new units: what the store commits now is removed again
                # (after the daemon heard of it, so its index stays in step).
                drained = [k for op, k in batch if op == "commit" and k not in self._pinned] if self.draining else []
                if self._overflow:
                    self._overflow = False
                    need_attach = True
            if not batch:
                continue
            try:
                if need_attach and self._geometry is not None:
                    if self._attach() is None:
                        raise ConnectionRefusedError("daemon still away")
                    need_attach = False
                # Consecutive notifications of one kind go in one request.
                i = 0
                while i < len(batch):
                    op = batch[i][0]
                    j = i
                    while j < len(batch) and batch[j][0] == op:
                        j += 1
                    self.request(make_request(_NOTIFICATIONS[op], instance=self.config.instance,
                                              keys=[k for _, k in batch[i:j]]))
                    i = j
            except (OSError, TuttiError) as exc:
                self.dropped += len(batch)
                need_attach = True  # the daemon rescans our headers on re-attach
                log.debug("daemon notification dropped: %s", exc)
            for k in drained:
                with contextlib.suppress(TuttiError):
                    self._store.remove(k)
            with self._cv:
                self._inflight = 0

    # -- admin commands ---------------------------------------------------------------------------
    def _command_loop(self) -> None:
        """Take the daemon's admin commands for this instance, apply them to the store and report
        the results (with the store's counters) on the next request; reconnect when the daemon
        comes back."""
        results: list[CommandResult] = []
        rfile: Any = None
        while not self._closed.is_set():
            try:
                if self._cmd_sock is None:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(COMMAND_WAIT_MS / 1000 + self.timeout_s + ADMIN_TIMEOUT_S)
                    try:
                        s.connect(self.path)
                    except OSError:
                        s.close()
                        raise
                    self._cmd_sock, rfile = s, s.makefile("rb")
                cluster = None
                if self.cluster_stats is not None:
                    cluster = {k: v for k, v in self.cluster_stats().items() if isinstance(v, (int, float))}
                req = make_request(CommandsRequest, instance=self.config.instance, wait_ms=COMMAND_WAIT_MS,
                                   results=results, queued=len(self._queue), stats=self._store_stats(), cluster=cluster)
                self._cmd_sock.sendall(req.model_dump_json().encode() + b"\n")
                line = rfile.readline(MAX_LINE)
                if not line:
                    raise ConnectionResetError("daemon closed the command channel")
                results = []
                reply = dict(json.loads(line))
                if reply.get("ok") is not True:
                    exc = ErrorReply.model_validate(reply).exception()
                    if isinstance(exc, NotFound):  # a daemon that does not know us: attach again
                        try:
                            self._attach()
                        except TuttiError as refused:  # for good (no capacity, a bad geometry): stop asking
                            log.warning("node daemon at %s refused this instance (%s); the store works alone",
                                        self.path, refused)
                            self.pending = False
                            break
                    raise exc
                self.pending = False  # the daemon knows us
                for cmd in CommandsReply.model_validate(reply).commands:
                    results.append(self._apply(cmd))
            except (OSError, ValueError, TuttiError, ValidationError) as exc:
                results = []  # lost with the connection; the admin op reports them unreachable
                if self._cmd_sock is not None:
                    with contextlib.suppress(OSError):
                        self._cmd_sock.close()
                self._cmd_sock = rfile = None
                log.debug("daemon command channel: %s", exc)
                self._closed.wait(0.5)
        if self._cmd_sock is not None:
            with contextlib.suppress(OSError):
                self._cmd_sock.close()
            self._cmd_sock = None
        with self._cv:
            self._cmd_thread = None  # a later attach opens the channel again

    def _store_stats(self) -> dict[str, Any]:
        try:
            st = self._store.stats()
        except (TuttiError, AttributeError):
            return {}
        out = {k: v for k, v in st.items() if isinstance(v, (int, float, bool, str))}
        if self.extra_stats is not None:
            for k, v in self.extra_stats().items():
                out[k] = int(out.get(k, 0) or 0) + int(v)
        return out

    def _apply(self, cmd: Command) -> CommandResult:
        """One admin command on the store: pins are the link's own (one store pin per key, however
        often it is pinned; a memory pin also queues the unit's copy into the memory tier), removals
        leave pinned units in place."""
        cid, kind, keys = cmd.id, cmd.cmd, list(cmd.keys)
        done: list[int] = []
        absent: list[int] = []
        skipped: list[int] = []
        st = self._store
        try:
            if kind == "pin":
                present = [k for k in keys if st.contains(k)]
                self._pinned.difference_update(set(keys) - set(present))  # gone since: pin afresh
                new = [k for k in present if k not in self._pinned]
                if new:
                    st.pin(new)
                    self._pinned.update(new)
                if cmd.memory and present:
                    st.promote(present)
                done, absent = present, [k for k in keys if k not in self._pinned]
                if cmd.memory and present and not st.stats().get("memory_slots"):
                    skipped = present  # pinned where they lie: this store has no memory tier
            elif kind == "tiers":
                tiers = st.unit_tiers(keys)
                self.commands_applied += 1
                return CommandResult(id=cid, tiers=tiers)
            elif kind == "unpin":
                done = [k for k in keys if k in self._pinned]
                if done:
                    st.unpin(done)
                    self._pinned.difference_update(done)
                skipped = [k for k in keys if k not in set(done)]
            elif kind == "remove":
                for k in keys:
                    if k in self._pinned:
                        skipped.append(k)
                    elif st.remove(k):
                        done.append(k)
                    else:  # absent, or being read right now (it stays)
                        (skipped if st.contains(k) else absent).append(k)
            elif kind == "drain":
                self.draining = cmd.on
            else:
                return CommandResult(id=cid, error=f"unknown admin command {kind!r}"[:1000])
        except TuttiError as exc:
            return CommandResult(id=cid, done=done, absent=absent, skipped=skipped, error=str(exc)[:1000])
        self.commands_applied += 1
        return CommandResult(id=cid, done=done, absent=absent, skipped=skipped)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until queued notifications were handed to the daemon (tests, clean shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._cv:
                if not self._queue and not self._inflight:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(self.timeout_s + 1)
        self._closed.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # ends a request of the command thread (a re-attach)
        with self._lock:
            self._drop()
        sock = self._cmd_sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # ends a wait in the daemon's command channel
        t = self._cmd_thread
        if t is not None:
            t.join(self.timeout_s + 1)

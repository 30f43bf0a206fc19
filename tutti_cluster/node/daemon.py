"""The node daemon (`tutti up`): storage shares, the node-wide index and, in cluster mode, the
replica directory and the stage endpoint that serves this node's units to other nodes.

Processes on a node. Each engine (GPU) process runs its own :class:`~tutti_cluster.TuttiStore`
instance with its own pool files (``<path>/tutti-<instance>*.pool``) and does all of its data path
itself. The daemon never sits on that path. Engines and the daemon share two things:

- the pool-file headers on disk, which are the truth: at start the daemon opens every known
  instance's pools read-only (:class:`~tutti_cluster.node.pool_view.PoolView`) and rebuilds the
  node-wide index from their headers;
- a unix socket ``<data_dir>/tutti.sock`` with JSON-lines requests (:mod:`tutti_cluster.node.protocol`;
  :class:`~tutti_cluster.node.link.DaemonLink` is the engine side): ``attach`` (an instance announces
  its geometry and gets its capacity share), ``commit`` / ``evict`` (keys, sent in the background from
  ``store.on_commit`` / ``on_evict``), ``lookup``, ``stats``, ``ping``, and the admin ops
  (:mod:`tutti_cluster.node.admin_ops`).

Only validated state reaches ``instances.json``, written atomically; at start an entry that does not
validate is skipped with a warning (the file as it was is kept beside it as ``instances.json.bad``).

Either side may die without hurting the other: the daemon drops a dead engine's connection and keeps
serving (its units stay readable from the pool files), and an engine whose daemon is gone keeps its
local store working; its notifications are dropped and the daemon rescans that instance's headers
when the engine attaches again or the daemon restarts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import signal
import socket
import socketserver
import stat
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Callable

from pydantic import BaseModel, Field, ValidationError
from pydantic_core import from_json

from tutti_cluster.config import TuttiConfig, check_instance_name, validation_summary
from tutti_cluster.errors import CapacityExceeded, ConfigError, LayoutError, NotFound, StorageError, TuttiError
from tutti_cluster.files import (MAX_STATE_BYTES, file_kind, group_id, make_dir, read_bounded, socket_mode,
                                  tighten_files, write_atomic)
from tutti_cluster.node.admin_ops import AdminOps
from tutti_cluster.node.handlers import HANDLERS, handles
from tutti_cluster.node.pool_view import PoolView
from tutti_cluster.node.protocol import (DIRECTORY_TIMEOUT_S, I63, LISTEN_BACKLOG, MAX_LINE, REQUESTS, SHUTDOWN_POLL_S,
                                         AttachReply, AttachRequest, CommitRequest, DirectoryCounters, ErrorReply,
                                         EvictRequest, Geometry, InstanceStats, LookupReply, LookupRequest,
                                         PingReply, PingRequest, Rates, RemoteCounters, Reply, Request,
                                         StageCounters, StatsReply, StatsRequest, StoreCounters, StrictModel,
                                         parse_request, socket_path)

log = logging.getLogger(__name__)

STATE_NAME = "instances.json"


class InstanceState(StrictModel):
    """One entry of ``instances.json``."""

    geometry: Geometry
    capacity: list[Annotated[int, Field(ge=0, le=I63)]]
    memory_capacity: list[Annotated[int, Field(ge=0, le=I63)]] = []  # [] without a memory tier


class NodeDaemon(AdminOps):
    """The daemon of one node. :meth:`start` returns once it serves; :meth:`stop` ends it."""

    def __init__(self, config: TuttiConfig, *, host: str | None = None, stage_port: int = 0,
                 arena_bytes: int = 256 << 20, directory_timeout_s: float = DIRECTORY_TIMEOUT_S,
                 advertise: dict[str, Any] | None = None) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir)
        self._file_gid = group_id(config.file_group)  # files.py: who besides this user reads our files
        # The address the Transfer Engine and the stage endpoint listen on and advertise: by default
        # config.advertise_host, else the one on the route to etcd (see advertised_host).
        self.host = host
        self.stage_port = stage_port
        self.arena_bytes = arena_bytes
        self.directory_timeout_s = directory_timeout_s
        self.node_id = config.node_id or socket.gethostname()
        self.capacity = config.capacity_bytes()
        self.paths = [str(p) for p in config.storage_paths()]
        # The memory tier's paths and bytes, shared out like the storage paths' ([]: none).
        self.memory_capacity = config.memory_capacity_bytes()
        self.memory_paths = [str(p) for p in config.memory_paths]
        self._lock = threading.RLock()
        self._attach_locks: dict[str, threading.Lock] = {}  # one per instance name (see _attach)
        # Shares (storage, memory) granted to attaches still opening their pools.
        self._reserved: dict[str, tuple[list[int], list[int]]] = {}
        self._slots_lock = threading.Lock()
        self._instances: dict[str, PoolView] = {}
        self._index: dict[int, set[str]] = {}
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket bound: removed at stop
        self._thread: threading.Thread | None = None
        self.directory: Any = None
        self.transfer: Any = None
        self.stage: Any = None
        self.counters = {"commits": 0, "evictions": 0, "lookups": 0, "attaches": 0, "stage_reads": 0,
                         "unreadable_units": 0}
        # Admin plane (docs/ADMIN.md, admin_ops.py). ``advertise`` goes into the node's cluster
        # record (the admin API's address).
        self.advertise = dict(advertise or {})
        self._init_admin()

    # -- state ------------------------------------------------------------------------------------
    def _state_file(self) -> Path:
        return self.data_dir / STATE_NAME

    def _load_state(self) -> dict[str, InstanceState]:
        """The saved shares. An entry that does not validate is skipped with a warning naming it
        (an unreadable file as a whole, too), and the file as it was is kept as ``instances.json.bad``:
        a bad entry never stops the daemon and nothing is lost."""
        path = self._state_file()
        try:
            raw = read_bounded(path, MAX_STATE_BYTES, what="daemon state")  # a regular file, never a link
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise StorageError(f"daemon state {path} is unreadable: {exc}") from exc
        out: dict[str, InstanceState] = {}
        bad = False
        try:
            data = from_json(raw, allow_inf_nan=False)
        except ValueError as exc:
            log.warning("daemon state %s is not JSON (%s): starting with no instances", path, exc)
            data, bad = {}, True
        if not isinstance(data, dict):
            log.warning("daemon state %s holds a %s, not an object: starting with no instances",
                        path, type(data).__name__)
            data, bad = {}, True
        for name, ent in data.items():
            try:
                check_instance_name(name)
                out[name] = InstanceState.model_validate(ent)
            except (ConfigError, ValidationError) as exc:
                why = validation_summary(exc) if isinstance(exc, ValidationError) else str(exc)
                log.warning("daemon state %s: instance %.80r skipped: %s", path, name, why)
                bad = True
        if bad:
            keep = path.with_name(STATE_NAME + ".bad")
            try:
                write_atomic(keep, raw, self._file_gid, sync=False)
                log.warning("daemon state %s: the file as it was is kept as %s", path, keep)
            except OSError as exc:
                log.warning("cannot keep a copy of %s as %s: %s", path, keep, exc)
        return out

    def _save_state(self) -> None:
        """Write the shares atomically: a crash leaves the old or the new file, never a torn one."""
        state = {n: InstanceState.model_validate({"geometry": v.geometry, "capacity": v.capacity,
                                                  "memory_capacity": v.memory_capacity}).model_dump()
                 for n, v in self._instances.items()}
        path = self._state_file()
        try:
            write_atomic(path, json.dumps(state, indent=1).encode(), self._file_gid)
        except OSError as exc:
            # A full or read-only data_dir must not stop the daemon from serving; the shares are
            # kept in memory and written again with the next change.
            log.warning("cannot save daemon state to %s: %s", path, exc)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> "NodeDaemon":
        """Load the shares, rescan every instance's pools and serve. StorageError when the data
        directory cannot hold the socket (missing permission, read-only file system)."""
        make_dir(self.data_dir, self._file_gid)  # owner-only (files.py), StorageError when it cannot be made
        tighten_files(self.data_dir, self._file_gid)  # an older build's 0644 token and state: owner-only now
        self._pins = self._load_pins()
        for name, ent in self._load_state().items():
            view = PoolView(self.config, name, ent.geometry.model_dump(), list(ent.capacity),
                            list(ent.memory_capacity))
            self._instances[name] = view
            self._rescan(view)
        if self.config.cluster_mode:
            self._start_cluster()
        self._start_socket()
        log.info("node daemon %s serving %d instances, %d units, socket %s", self.node_id,
                 len(self._instances), len(self._index), socket_path(self.config))
        return self

    def _start_cluster(self) -> None:
        from tutti_cluster.cluster.directory import EtcdDirectory, NodeRecord
        from tutti_cluster.cluster.stage import StageServer
        from tutti_cluster.cluster.transfer import TransferNode

        if not self.config.etcd:
            raise ConfigError("cluster mode needs etcd endpoints (TUTTI_ETCD): the replica directory lives there")
        from tutti_cluster.cluster.etcd import EtcdSecurity

        etcd_security = EtcdSecurity.from_config(self.config)  # ConfigError before anything listens
        from tutti_cluster.cluster.auth import cluster_secret

        # The cluster credential: every stage connection proves it, every directory record is signed with it.
        secret = cluster_secret(self.config)  # ConfigError (saying how to make one) before anything listens
        if self.config.mooncake_master:
            # Replicas live in Tutti's pools, not in Mooncake Store segments: the master has no part
            # in registering or moving them (docs/CLUSTER.md, "Directory choice").
            log.info("mooncake_master %s is not used by the replica directory (etcd) or the data path",
                     self.config.mooncake_master)
        from tutti_cluster.cluster.directory import advertised_host

        if self.host is None:
            self.host = advertised_host(self.config)
        slot = max((v.slot_bytes() for v in self._instances.values()), default=0)
        self.transfer = TransferNode(self.host, self.config.protocol, self.arena_bytes, slot_bytes=slot,
                                     ports=self.config.transfer_ports)
        self.stage = StageServer(self.transfer, None, host=self.host, port=self.stage_port or self.config.stage_port,
                                 read_into=self._read_into, check=self._check_unit, secret=secret).start()
        self.directory = EtcdDirectory(",".join(self.config.etcd), self.node_id, self.config.lease_ttl_s,
                                       timeout_s=self.directory_timeout_s, security=etcd_security, secret=secret)
        with self._lock:
            keys = list(self._index)
        self.directory.register(keys)  # queued until start() has a lease
        self.directory.start(NodeRecord(self.node_id, self.transfer.segment, self.stage.address,
                                        {"pid": os.getpid(), **self.advertise}))

    def _start_socket(self) -> None:
        path = socket_path(self.config)
        if os.path.lexists(path):
            kind = os.lstat(path).st_mode
            if not (stat.S_ISSOCK(kind) or stat.S_ISLNK(kind)):  # never remove a file that is not a socket
                raise StorageError(f"{path} is not a socket but {file_kind(kind)}: it is never removed (move it "
                                   "away)")
            # A live daemon answers; a stale socket (crashed daemon) is replaced.
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(1.0)
                    s.connect(str(path))
                raise ConfigError(f"another node daemon already serves {path}")
            except OSError:
                try:
                    path.unlink()
                except OSError as exc:
                    raise StorageError(f"cannot replace the stale socket {path}: {exc.strerror or exc}") from None
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                outer._serve(self.rfile, self.wfile)

        class Server(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True
            request_queue_size = LISTEN_BACKLOG

        try:
            self._server = Server(str(path), Handler)
        except OSError as exc:
            raise StorageError(f"cannot listen on {path}: {exc.strerror or exc} (the data directory must be "
                               "writable)") from None
        st = os.lstat(path)
        self._socket_id = (st.st_dev, st.st_ino)
        try:  # connecting needs write permission on the socket: this user, and file_group when set
            os.chmod(path, socket_mode(self._file_gid))
            if self._file_gid is not None:
                os.chown(path, -1, self._file_gid)
        except OSError as exc:
            self._server.server_close()
            self._server = None
            with contextlib.suppress(OSError):
                path.unlink()
            raise StorageError(f"cannot set the mode of {path}: {exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, args=(SHUTDOWN_POLL_S,), name="tutti-daemon", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cmd_cv:
            self._stopping = True  # engines' command waits and admin waits end now
            self._cmd_cv.notify_all()
        if self._drain_thread is not None:
            self._drain_thread.join(5)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            path = socket_path(self.config)
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) == self._socket_id:  # never another daemon's, started since
                    path.unlink()
            self._server = None
        if self.directory is not None:
            self.directory.stop(revoke=True)
        if self.stage is not None:
            self.stage.stop()
        for view in self._instances.values():
            view.close()

    # -- index ------------------------------------------------------------------------------------
    def _rescan(self, view: PoolView) -> None:
        """Rebuild the index entries of one instance from its pool headers."""
        self._index_instance(view, self._open_view(view))

    def _open_view(self, view: PoolView, refuse: tuple[type[TuttiError], ...] = ()) -> list[int]:
        """The keys in ``view``'s pools; [] (logged) when they cannot be read, unless the error is
        one of ``refuse``, which is raised."""
        try:
            return view.open()
        except refuse:
            view.close()
            raise
        except TuttiError as exc:
            log.warning("instance %s: pools not readable (%s); its units are not served", view.name, exc)
            return []

    def _index_instance(self, view: PoolView, keys: list[int]) -> None:
        with self._lock:
            for owners in self._index.values():
                owners.discard(view.name)
            for k in keys:
                self._index.setdefault(k, set()).add(view.name)
            for k in [k for k, o in self._index.items() if not o]:
                del self._index[k]
        if self.directory is not None:
            self.directory.register(keys)
        self._fit_slots(view)

    def _fit_slots(self, view: PoolView) -> None:
        """Size the staging slots for ``view``'s units (the largest unit of any instance)."""
        if self.transfer is None:
            return
        need = view.slot_bytes()
        with self._slots_lock:  # attaches run at once: a smaller size must never follow a larger one
            if need <= self.transfer.slot_bytes:
                return
            try:
                self.transfer.configure(need)
            except TuttiError as exc:
                # Slots are out (a stream is running) or the arena is too small: units of this
                # instance are misses for other nodes until the next attach resizes the slots.
                log.warning("staging slots stay at %d bytes, instance %s needs %d: %s",
                            self.transfer.slot_bytes, view.name, need, exc)

    def _read_into(self, key: int, view: memoryview) -> int | None:
        """Stage endpoint reader: the unit, from whichever local instance holds it, into a registered slot."""
        with self._lock:
            owners = list(self._index.get(key, ()))
            views = [self._instances[o] for o in owners if o in self._instances]
        self.counters["stage_reads"] += 1
        asked = time.monotonic()
        for v in views:
            try:
                got = v.read_into(key, view)
            except CapacityExceeded as exc:  # our staging slot is too small: not the unit's fault
                log.warning("unit %x of instance %s not staged: %s", key, v.name, exc)
                continue
            except TuttiError as exc:
                self._drop_unreadable(v, key, str(exc))
                continue
            if got is not None:
                return got
            if not v.holds(key, since=asked):
                # Listed but not in the pool headers after a rescan: its header is damaged, or it
                # was overwritten after an eviction we have not heard of yet.
                self._drop_unreadable(v, key, "not in its pool headers")
        return None

    def _drop_unreadable(self, v: PoolView, key: int, why: str) -> None:
        """A unit listed for ``v`` that cannot be read, for any reason: stop advertising it, so that
        other nodes do not keep asking for it."""
        self.counters["unreadable_units"] += 1
        log.warning("unit %x of instance %s is unreadable (%s): no longer advertised", key, v.name, why)
        self._evict(v.name, [key], count=False)

    def _check_unit(self, key: int) -> None:
        """A requester found ``key`` corrupt: verify our copies and stop advertising bad ones."""
        with self._lock:
            views = [self._instances[o] for o in self._index.get(key, ()) if o in self._instances]
        asked = time.monotonic()
        for v in views:
            buf = mmap.mmap(-1, max(v.slot_bytes(), mmap.PAGESIZE))  # page-aligned: read in place
            try:
                with memoryview(buf) as view:
                    got = v.read_into(key, view, verify=True)
                if got is None and not v.holds(key, since=asked):
                    self._drop_unreadable(v, key, "not in its pool headers")
            except CapacityExceeded as exc:
                log.warning("cannot check unit %x of instance %s: %s", key, v.name, exc)
            except TuttiError as exc:
                self._drop_unreadable(v, key, str(exc))
            finally:
                buf.close()

    # -- requests ---------------------------------------------------------------------------------
    def _serve(self, rfile: Any, wfile: Any) -> None:
        """One connection: a reply line for every request line, until the peer closes."""
        while True:
            try:
                line = rfile.readline(MAX_LINE)
            except OSError:
                return
            if not line:
                return  # engine closed or died: nothing to clean up, its units stay on disk
            if len(line) == MAX_LINE and not line.endswith(b"\n"):
                # Too long: skip to its end (bounded memory), refuse it, read on.
                try:
                    while (more := rfile.readline(1 << 20)) and not more.endswith(b"\n"):
                        pass
                except OSError:
                    return
                reply: BaseModel = ErrorReply.of(ConfigError(f"request line longer than {MAX_LINE} bytes"))
            else:
                reply = self._reply(line)
            try:
                wfile.write(reply.model_dump_json(by_alias=True).encode() + b"\n")
                wfile.flush()
            except OSError:
                return

    def _reply(self, line: bytes | str | dict[str, Any]) -> BaseModel:
        try:
            return self._dispatch(parse_request(line))
        except TuttiError as exc:
            return ErrorReply.of(exc)
        except Exception as exc:  # a defect: answer it and keep the connection and the daemon
            log.exception("daemon request failed")
            return ErrorReply.of(TuttiError(f"internal error: {type(exc).__name__}: {exc}"))

    def _dispatch(self, req: Request) -> Reply:
        return HANDLERS[req.op_name()][1](self, req)

    def handle(self, msg: dict[str, Any] | Request) -> dict[str, Any]:
        """One request in process; returns the reply (``ok`` plus fields). Raises TuttiError on bad input."""
        req = msg if isinstance(msg, Request) else parse_request(msg)
        return self._dispatch(req).model_dump(by_alias=True)

    @handles(PingRequest)
    def _ping(self, req: PingRequest) -> Reply:
        return PingReply(node_id=self.node_id)

    @handles(StatsRequest)
    def _stats(self, req: StatsRequest) -> Reply:
        return self.stats_reply()

    @handles(LookupRequest)
    def _lookup_op(self, req: LookupRequest) -> Reply:
        return self._lookup(req.keys, req.remote)

    @handles(CommitRequest)
    def _commit_op(self, req: CommitRequest) -> Reply:
        self._known(req.instance)
        self._commit(req.instance, req.keys)
        return Reply()

    @handles(EvictRequest)
    def _evict_op(self, req: EvictRequest) -> Reply:
        self._known(req.instance)
        self._evict(req.instance, req.keys)
        return Reply()

    def _known(self, name: str) -> None:
        with self._lock:
            if name not in self._instances:
                # The link re-attaches after an error reply, and the rescan then picks up its units.
                raise NotFound(f"instance {name!r} is not attached to this daemon")

    @handles(AttachRequest)
    def _attach(self, req: AttachRequest) -> Reply:
        """Grant (or confirm) an instance's share: its own request, capped by what is left.

        The memory tier is shared out the same way, where both the node and the instance have one
        (the node's read-only view then opens the instance's memory tier too); an instance that
        keeps its storage share but comes with a memory tier it had no share of gets one now.
        The geometry is checked against the instance's pools before anything is stored: one that
        does not describe them (LayoutError, ConfigError) is refused and the old state kept. Pools
        the daemon cannot see (another path, not created yet) are logged, and the share is granted.
        """
        name, geometry = req.instance, req.geometry.model_dump()
        # One attach of an instance at a time; other instances' attaches run beside it (the engines
        # of a node start together, and opening large pools takes a while): a new instance's share
        # is reserved while its pools open, so that shares granted at once never add up past the node.
        with self._lock:
            attach_lock = self._attach_locks.setdefault(name, threading.Lock())
        with attach_lock:
            with self._lock:
                old = self._instances.get(name)
                if old is None:
                    left = self._left(self.capacity, 0)
                    want = list(req.capacity) if req.capacity is not None else left
                    if len(want) != len(self.paths):
                        raise ConfigError(f"capacity request has {len(want)} values for {len(self.paths)} paths")
                    grant = [min(r, lft) for r, lft in zip(want, left)]
                    if sum(grant) == 0:
                        raise CapacityExceeded(f"no capacity left on this node for instance {name!r}")
                    if self._drain is not None:
                        raise CapacityExceeded(f"node {self.node_id} is draining: it takes no new instance ({name!r})")
                else:
                    grant = old.capacity
                memory = self._memory_grant(name, req.memory_capacity, old)
                # What this attach takes beyond the shares the instance already holds.
                self._reserved[name] = ([] if old is not None else grant,
                                        [] if old is not None and memory == old.memory_capacity else memory)
            try:
                if old is not None and old.geometry == geometry and old.memory_capacity == memory:
                    view = old
                    keys = self._open_view(view)
                else:
                    view = PoolView(self.config, name, geometry, grant, memory)
                    keys = self._open_view(view, refuse=(LayoutError, ConfigError))  # raises: nothing stored
                with self._lock:
                    self._instances[name] = view
                    self._reserved.pop(name, None)  # with the line above: never counted twice
                    self._save_state()
                    self.counters["attaches"] += 1
            except BaseException:
                with self._lock:
                    self._reserved.pop(name, None)  # the attach failed: its share is free again
                raise
            if old is not None and old is not view:
                old.close()
            self._index_instance(view, keys)  # a returning engine may have committed while we were apart
        with self._cmd_cv:
            if name in self._engines:
                self._engines[name]["synced"] = False  # a new store: its pins and drain state are sent again
        return AttachReply(paths=self.paths, capacity=view.capacity, node_id=self.node_id,
                           memory_paths=self.memory_paths if view.memory_capacity else [],
                           memory_capacity=view.memory_capacity)

    def _left(self, total: list[int], tier: int) -> list[int]:
        """Bytes of each path of a tier (0: storage, 1: memory) that no instance holds or is being
        granted. Under ``self._lock``."""
        shares = [*((v.capacity, v.memory_capacity)[tier] for v in self._instances.values()),
                  *(r[tier] for r in self._reserved.values())]
        used = [sum(c[i] for c in shares if i < len(c)) for i in range(len(total))]
        return [max(0, c - u) for c, u in zip(total, used)]

    def _memory_grant(self, name: str, want: list[int] | None, old: PoolView | None) -> list[int]:
        """An instance's share of the memory tier: [] where it asks for none or the node has none,
        the share it holds where it has one, else its request capped by what is left. Under
        ``self._lock``."""
        if not want or not any(want):
            return []
        if not self.memory_paths:
            log.info("instance %s has a memory tier, this node's daemon none (memory_paths unset here): its units "
                     "are served to other nodes once their storage copy is written", name)
            return []
        if len(want) != len(self.memory_paths):
            raise ConfigError(f"memory capacity request has {len(want)} values for {len(self.memory_paths)} memory "
                              "paths")
        if old is not None and len(old.memory_capacity) == len(want):
            return old.memory_capacity
        grant = [min(r, lft) for r, lft in zip(want, self._left(self.memory_capacity, 1))]
        if sum(grant) == 0:
            raise CapacityExceeded(f"no memory-tier capacity left on this node for instance {name!r}")
        return grant

    def _commit(self, name: str, keys: list[int]) -> None:
        with self._lock:
            # Before the keys are listed: a read that finds one listed waits for the view's next
            # rescan instead of missing it (PoolView.read_into).
            self._instances[name].committed_at = time.monotonic()
            for k in keys:
                self._index.setdefault(k, set()).add(name)
            self.counters["commits"] += len(keys)
        if self.directory is not None:
            self.directory.register(keys)

    def _evict(self, name: str, keys: list[int], count: bool = True) -> None:
        gone = []
        with self._lock:
            for k in keys:
                owners = self._index.get(k)
                if owners is None:
                    continue
                owners.discard(name)
                if not owners:
                    del self._index[k]
                    gone.append(k)
            if count:  # admin removals are counted when the engine's own notice arrives
                self.counters["evictions"] += len(keys)
        if self.directory is not None and gone:
            self.directory.unregister(gone)  # other local instances may still hold the rest

    def _lookup(self, keys: list[int], remote: bool) -> LookupReply:
        """Leading units held on this node, then (cluster mode) their owners elsewhere."""
        self.counters["lookups"] += 1
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._index:
                    break
                n += 1
        owners: list[list[str]] = []
        if remote and self.directory is not None and n < len(keys):
            owners = self.directory.lookup(keys[n:], prefix=True)
        return LookupReply(local=n, remote=owners)

    def stats(self) -> dict[str, Any]:
        """The ``stats`` reply as a dict (in-process callers)."""
        return self.stats_reply().model_dump()

    def stats_reply(self) -> StatsReply:
        """The node's counters: the index, the daemon's own, each instance, the drain, the cluster."""
        with self._lock:
            head: dict[str, Any] = {
                "node_id": self.node_id, "units": len(self._index), "paths": self.paths,
                "capacity": self.capacity, "memory_paths": self.memory_paths, "memory_capacity": self.memory_capacity,
                "cluster_mode": self.config.cluster_mode, "pins": len(self._pins),
                **self.counters,
            }
            views = dict(self._instances)
            held = dict.fromkeys(views, 0)
            for owners in self._index.values():
                for name in owners:
                    if name in held:
                        held[name] += 1
        seen: dict[str, dict[str, Any]] = {}
        for name, v in views.items():
            view = v.stats()
            if view:
                # Units and slots as the index has them: it follows every commit and eviction the
                # engines report, while the view counts what its last rescan of the headers found
                # (each unit committed or evicted since takes or frees a slot; with a memory tier, a
                # unit in both tiers holds two).
                scanned = int(view.get("units", 0))
                view["units"] = held[name]
                view["free_slots"] = max(0, int(view.get("free_slots", 0)) - (held[name] - scanned))
            seen[name] = view
        instances: dict[str, InstanceStats] = {}
        with self._cmd_cv:
            for name, v in views.items():
                e = self._engines.get(name) or {}
                eng, remote = e.get("stats"), e.get("cluster")
                instances[name] = InstanceStats(
                    capacity=v.capacity, memory_capacity=v.memory_capacity, view=StoreCounters.model_validate(seen[name]),
                    engine=None if eng is None else StoreCounters.model_validate(eng),
                    engine_connected=self._engine_live(name), rates=Rates.model_validate(e.get("rates", {})),
                    cluster=None if remote is None else RemoteCounters.model_validate(remote),
                    notification_queue=e.get("queued", 0), command_queue=len(self._commands.get(name, ())))
        cluster: dict[str, Any] = {}
        if self.directory is not None:
            cluster["directory"] = DirectoryCounters.model_validate(self.directory.stats.as_dict())
        if self.stage is not None:
            cluster.update(stage=StageCounters.model_validate(self.stage.stats.as_dict()),
                           stage_address=self.stage.address, segment=self.transfer.segment)
        return StatsReply(**head, instances=instances, drain=self.drain_status(), **cluster)

if HANDLERS.keys() != REQUESTS.keys():
    raise TypeError(f"daemon ops without a handler: {sorted(REQUESTS.keys() - HANDLERS.keys())}; "
                    f"handlers without a request model: {sorted(HANDLERS.keys() - REQUESTS.keys())}")

# How long `tutti up` waits for the daemon to stop after SIGINT or SIGTERM (an etcd that does not
# answer, storage that hangs): past it the process ends without waiting further.
STOP_TIMEOUT_S = 10.0


def run_daemon(config: TuttiConfig, ready: Callable[[NodeDaemon], None] | None = None,
               advertise: dict[str, Any] | None = None) -> bool:
    """Run the node daemon until SIGINT or SIGTERM (``tutti up``). ``ready`` is called once it
    serves; ``advertise`` joins the node's cluster record (e.g. ``{"admin": "host:port"}``).
    Returns whether the daemon stopped within :data:`STOP_TIMEOUT_S`; False (logged) leaves it
    stopping in a daemon thread, and the caller's process should end now."""
    daemon = NodeDaemon(config, advertise=advertise).start()
    done = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
        log.info("node daemon stopping (signal %d)", signum)
        done.set()

    old = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if ready is not None:
            ready(daemon)
        while not done.wait(1.0):
            pass
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        stopper = threading.Thread(target=daemon.stop, name="tutti-daemon-stop", daemon=True)
        stopper.start()
        stopper.join(STOP_TIMEOUT_S)
        stopped = not stopper.is_alive()
        if not stopped:
            log.warning("node daemon did not stop within %.0f s (etcd or storage not answering?); exiting without "
                        "waiting further", STOP_TIMEOUT_S)
    return stopped

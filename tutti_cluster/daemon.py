"""The node daemon (`tutti up`): storage shares, the node-wide index and, in cluster mode, the
replica directory and the stage endpoint that serves this node's units to other nodes.

Processes on a node. Each engine (GPU) process runs its own :class:`~tutti_cluster.TuttiStore`
instance with its own pool files (``<path>/tutti-<instance>*.pool``) and does all of its data path
itself. The daemon never sits on that path. Engines and the daemon share two things:

- the pool-file headers on disk, which are the truth: at start the daemon opens every known
  instance's pools read-only and rebuilds the node-wide index from their headers;
- a unix socket ``<data_dir>/tutti.sock`` with JSON-lines requests (:class:`DaemonLink` is the
  engine side): ``attach`` (an instance announces its geometry and gets its capacity share),
  ``commit`` / ``evict`` (keys, sent in the background from ``store.on_commit`` / ``on_evict``),
  ``lookup``, ``stats``, ``ping``.

The protocol. Each request is one JSON object on one line, validated by the pydantic model of its
``op`` (one :class:`Request` subclass per op, one handler per op, joined by :func:`handles`; a new op
is a model plus a method). Each reply is one line: ``{"ok": true, ...}`` or, for anything refused,
``{"ok": false, "error": {"class": "<TuttiError subclass>", "message": "..."}}``. Malformed lines
(not UTF-8, not JSON, not an object, unknown op, wrong field types, non-finite or out-of-range
numbers, nesting deeper than the parser's limit, longer than :data:`MAX_LINE`) get that error reply
and the connection reads on. :class:`DaemonLink` raises the error's class on the engine side.
Only validated state reaches ``instances.json``, written atomically; at start an entry that does not
validate is skipped with a warning (the file as it was is kept beside it as ``instances.json.bad``).

Either side may die without hurting the other: the daemon drops a dead engine's connection and keeps
serving (its units stay readable from the pool files), and an engine whose daemon is gone keeps its
local store working; its notifications are dropped and the daemon rescans that instance's headers
when the engine attaches again or the daemon restarts.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import random
import signal
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Iterator, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from pydantic_core import from_json

from tutti_cluster.config import (INSTANCE_MAX_CHARS, INSTANCE_PATTERN, TuttiConfig, check_instance_name,
                                  validation_summary)
from tutti_cluster.errors import (CapacityExceeded, ConfigError, LayoutError, NotFound, StorageError, TuttiError,
                                  error_class)

log = logging.getLogger(__name__)

SOCKET_NAME = "tutti.sock"
STATE_NAME = "instances.json"
# Longest request or reply line in bytes, newline included. A commit batch of 65536 keys (the
# link's queue) is about 1.4 MB.
MAX_LINE = 16 << 20
# listen() backlog of the socket: engines of a whole node attach at once when a server starts.
LISTEN_BACKLOG = 128


# -- messages ------------------------------------------------------------------------------------
_U64 = (1 << 64) - 1
_I63 = (1 << 63) - 1
InstanceName = Annotated[str, StringConstraints(pattern=f"^{INSTANCE_PATTERN}$", max_length=INSTANCE_MAX_CHARS)]
UnitKey = Annotated[int, Field(ge=0, le=_U64)]
_Positive = Annotated[int, Field(gt=0, le=_I63)]


class _Model(BaseModel):
    # strict: a key is an int, not "7", 7.0 or true; extra fields are mistakes.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Geometry(_Model):
    """What the daemon needs to open an engine's pools read-only (no pointers: it never scatters)."""

    num_layers: Annotated[int, Field(gt=0, le=4096)]
    nptr: Literal[1, 2]
    block_stride: _Positive
    block_bytes: Annotated[int, Field(gt=0, le=1 << 40)]
    num_blocks: Annotated[int, Field(gt=0, le=1 << 40)]
    dtype: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_]*$", max_length=32)] = ""
    block_shape: Annotated[list[Annotated[int, Field(gt=0, le=1 << 40)]], Field(max_length=8)] = []
    block_tokens: Annotated[int, Field(gt=0, le=1 << 24)]
    unit_tokens: Annotated[int, Field(gt=0, le=1 << 30)]

    @model_validator(mode="after")
    def _fits(self) -> "Geometry":
        if self.unit_tokens % self.block_tokens:
            raise ValueError(f"unit_tokens ({self.unit_tokens}) must be a multiple of block_tokens "
                             f"({self.block_tokens})")
        if self.block_stride < self.block_bytes:
            raise ValueError(f"block_stride ({self.block_stride}) is below block_bytes ({self.block_bytes})")
        return self


class Request(_Model):
    """Base of every daemon request. A subclass per op, with ``op: Literal["<name>"] = "<name>"``."""

    op: str

    @classmethod
    def op_name(cls) -> str:
        return str(cls.model_fields["op"].default)


class AttachRequest(Request):
    """An instance announces its geometry; ``capacity`` (bytes per path) is what it asks for,
    absent for whatever is left."""

    op: Literal["attach"] = "attach"
    instance: InstanceName
    geometry: Geometry
    capacity: Annotated[list[Annotated[int, Field(ge=0, le=_I63)]], Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _some_capacity(self) -> "AttachRequest":
        if self.capacity is not None and not any(self.capacity):
            raise ValueError("a capacity request of zero bytes on every path asks for nothing")
        return self


class CommitRequest(Request):
    op: Literal["commit"] = "commit"
    instance: InstanceName
    keys: list[UnitKey]


class EvictRequest(Request):
    op: Literal["evict"] = "evict"
    instance: InstanceName
    keys: list[UnitKey]


class LookupRequest(Request):
    op: Literal["lookup"] = "lookup"
    keys: list[UnitKey]
    remote: bool = True


class StatsRequest(Request):
    op: Literal["stats"] = "stats"


class PingRequest(Request):
    op: Literal["ping"] = "ping"


class Reply(BaseModel):
    """A successful reply; subclasses add fields."""

    model_config = ConfigDict(extra="forbid")
    ok: Literal[True] = True


class AttachReply(Reply):
    paths: list[str]
    capacity: list[int]
    node_id: str


class LookupReply(Reply):
    local: int
    remote: list[list[str]]


class PingReply(Reply):
    node_id: str


class StatsReply(Reply):
    model_config = ConfigDict(extra="allow")  # counters and cluster sections, see NodeDaemon.stats


class ErrorBody(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    class_: str = Field(alias="class")
    message: str


class ErrorReply(BaseModel):
    """The one shape of every refusal: the TuttiError subclass's name and its message."""

    ok: Literal[False] = False
    error: ErrorBody

    @classmethod
    def of(cls, exc: TuttiError) -> "ErrorReply":
        return cls(error=ErrorBody.model_validate({"class": type(exc).__name__, "message": str(exc)}))

    def exception(self) -> TuttiError:
        return error_class(self.error.class_)(f"node daemon: {self.error.message}")


class InstanceState(_Model):
    """One entry of ``instances.json``."""

    geometry: Geometry
    capacity: list[Annotated[int, Field(ge=0, le=_I63)]]


_R = TypeVar("_R", bound=Request)
# op name -> (request model, handler). Handlers are NodeDaemon methods taking their model.
_HANDLERS: dict[str, tuple[type[Request], Callable[..., Reply]]] = {}


def handles(model: type[_R]) -> Callable[[Callable[[Any, _R], Reply]], Callable[[Any, _R], Reply]]:
    """Registers the decorated NodeDaemon method as the handler of ``model``'s op."""

    def register(fn: Callable[[Any, _R], Reply]) -> Callable[[Any, _R], Reply]:
        name = model.op_name()
        if name in _HANDLERS:
            raise TypeError(f"daemon op {name!r} has two handlers")
        _HANDLERS[name] = (model, fn)
        return fn

    return register


def parse_request(line: bytes | str | dict[str, Any]) -> Request:
    """One request line (or an already decoded object) as its validated model; ConfigError if bad."""
    if isinstance(line, (bytes, bytearray)):
        try:
            line = bytes(line).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"request is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if isinstance(line, str):
        try:
            # pydantic's parser: nesting limited, NaN and Infinity refused, big numbers bounded.
            msg = from_json(line, allow_inf_nan=False)
        except ValueError as e:
            raise ConfigError(f"request is not JSON: {e}") from None
    else:
        msg = line
    if not isinstance(msg, dict):
        raise ConfigError(f"a request is a JSON object, not {type(msg).__name__}")
    op = msg.get("op")
    entry = _HANDLERS.get(op) if isinstance(op, str) else None
    if entry is None:
        shown = repr(op) if isinstance(op, str) and len(op) <= 64 else type(op).__name__
        raise ConfigError(f"unknown daemon request {shown}; known: {', '.join(sorted(_HANDLERS))}")
    try:
        return entry[0].model_validate(msg)
    except ValidationError as e:
        raise ConfigError(f"bad {op} request: {validation_summary(e)}") from None


def socket_path(config: TuttiConfig) -> Path:
    """Where the daemon of ``config.data_dir`` listens."""
    return Path(config.data_dir) / SOCKET_NAME


def geometry_of(store: Any) -> dict[str, Any]:
    """What the daemon needs to open an engine's pools read-only (no pointers: it never scatters)."""
    layers = store.layers
    l0 = layers[0]
    return {"num_layers": len(layers), "nptr": len(l0.ptrs), "block_stride": l0.block_stride,
            "block_bytes": l0.block_bytes, "num_blocks": l0.num_blocks, "dtype": l0.dtype,
            "block_shape": list(l0.block_shape), "block_tokens": store.block_tokens,
            "unit_tokens": store.config.unit_tokens}


class _InstanceView:
    """The daemon's read-only view of one engine instance's pools.

    One read-only store per instance, opened once. Units the engine commits later are picked up
    with ``store.refresh()`` (a rescan of the pool headers). Reads share the view and run in
    parallel (the stage endpoint reads from several threads; the store's reads release the GIL); a
    refresh, reopen or close holds it alone, since a refresh rebuilds the store's index in place.
    """

    def __init__(self, config: TuttiConfig, name: str, geometry: dict[str, Any], capacity: list[int]) -> None:
        self.name = name
        self.geometry = geometry
        self.capacity = capacity
        self.config = config.model_copy(update={"instance": name, "unit_tokens": geometry["unit_tokens"]})
        self.store: Any = None
        self._opened_geometry: dict[str, Any] | None = None
        self.refreshed_at = 0.0
        self._cv = threading.Condition()
        self._readers = 0
        self._exclusive = False

    @contextlib.contextmanager
    def _shared(self) -> Iterator[Any]:
        with self._cv:
            self._cv.wait_for(lambda: not self._exclusive)
            self._readers += 1
        try:
            yield self.store
        finally:
            with self._cv:
                self._readers -= 1
                if not self._readers:
                    self._cv.notify_all()

    @contextlib.contextmanager
    def _alone(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: not self._exclusive)
            self._exclusive = True  # new readers wait from here on
            self._cv.wait_for(lambda: not self._readers)
        try:
            yield
        finally:
            with self._cv:
                self._exclusive = False
                self._cv.notify_all()

    def open(self) -> list[int]:
        """Open the pools read-only (or rescan their headers when open) and return the keys they hold."""
        from tutti_cluster.kv_layout import LayerKV
        from tutti_cluster.store import TuttiStore

        with self._alone():
            g = self.geometry
            if self.store is not None and g == self._opened_geometry:
                self.store.refresh()
            else:
                # First open, or the engine came back with another geometry.
                if self.store is not None:
                    self.store.close()
                    self.store = None
                # Read-only stores never touch KV memory, so the pointers are placeholders.
                layer = LayerKV(ptrs=tuple(1 for _ in range(g["nptr"])), block_stride=g["block_stride"],
                                block_bytes=g["block_bytes"], num_blocks=g["num_blocks"], device="cpu",
                                dtype=g.get("dtype", ""), block_shape=tuple(g.get("block_shape", ())))
                st = TuttiStore(self.config)
                st.register_kv_caches([layer] * g["num_layers"], block_tokens=g["block_tokens"], read_only=True)
                self.store, self._opened_geometry = st, dict(g)
            self.refreshed_at = time.monotonic()
            return list(self.store.keys())

    def _refresh(self, seen: float) -> bool:
        """Rescan the headers unless another thread did since ``seen``; False when it failed."""
        with self._alone():
            if self.store is None:
                return False
            if self.refreshed_at > seen:
                return True
            try:
                self.store.refresh()
            except TuttiError as exc:
                log.warning("cannot rescan instance %s: %s", self.name, exc)
                return False
            finally:
                self.refreshed_at = time.monotonic()
            return True

    def read_into(self, key: int, view: memoryview, refresh_after_s: float = 0.2, verify: bool = False) -> int | None:
        """Read the unit of ``key`` straight into ``view``: its size, or None if absent.

        ``store.read_unit_into`` lands in place with O_DIRECT when ``view`` is 4 KiB aligned (the
        registered staging slots are), so a staged unit is never copied on this node. Unless
        ``verify``, only its header is checked here (key and layout): the requester verifies every
        object's checksum as it scatters, so a corrupt object is its miss (it reports it, and
        ``NodeDaemon`` then verifies its copy), and each byte is summed once. A key committed
        after our last rescan triggers one ``refresh()`` (at most every ``refresh_after_s``). Raises
        NotFound when the slot holds another unit (evicted and overwritten under us),
        CapacityExceeded when ``view`` is too small.
        """
        for attempt in range(2):
            with self._shared() as st:
                seen = self.refreshed_at
                if st is not None and st.contains(key):
                    return int(st.read_unit_into(key, view, verify=verify))
            if attempt or st is None or time.monotonic() - seen < refresh_after_s:
                return None
            if not self._refresh(seen):
                return None
        return None

    def slot_bytes(self) -> int:
        with self._shared() as st:
            return int(st.geometry()["slot_bytes"]) if st is not None else 0

    def close(self) -> None:
        with self._alone():
            st, self.store = self.store, None
        if st is not None:
            st.close()


class NodeDaemon:
    """The daemon of one node. :meth:`start` returns once it serves; :meth:`stop` ends it."""

    def __init__(self, config: TuttiConfig, *, host: str | None = None, stage_port: int = 0,
                 arena_bytes: int = 256 << 20, directory_timeout_s: float = 2.0) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir)
        # The address the Transfer Engine and the stage endpoint listen on and advertise: by default
        # the one on the route to etcd (see local_address_towards).
        self.host = host
        self.stage_port = stage_port
        self.arena_bytes = arena_bytes
        self.directory_timeout_s = directory_timeout_s
        self.node_id = config.node_id or socket.gethostname()
        self.capacity = config.capacity_bytes()
        self.paths = [str(p) for p in config.storage_paths()]
        self._lock = threading.RLock()
        self._attach_lock = threading.Lock()
        self._instances: dict[str, _InstanceView] = {}
        self._index: dict[int, set[str]] = {}
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._thread: threading.Thread | None = None
        self.directory: Any = None
        self.transfer: Any = None
        self.stage: Any = None
        self.counters = {"commits": 0, "evictions": 0, "lookups": 0, "attaches": 0, "stage_reads": 0,
                         "unreadable_units": 0}

    # -- state ------------------------------------------------------------------------------------
    def _state_file(self) -> Path:
        return self.data_dir / STATE_NAME

    def _load_state(self) -> dict[str, InstanceState]:
        """The saved shares. An entry that does not validate is skipped with a warning naming it
        (an unreadable file as a whole, too), and the file as it was is kept as ``instances.json.bad``:
        a bad entry never stops the daemon and nothing is lost."""
        path = self._state_file()
        try:
            raw = path.read_bytes()
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
                keep.write_bytes(raw)
                log.warning("daemon state %s: the file as it was is kept as %s", path, keep)
            except OSError as exc:
                log.warning("cannot keep a copy of %s as %s: %s", path, keep, exc)
        return out

    def _save_state(self) -> None:
        """Write the shares atomically: a crash leaves the old or the new file, never a torn one."""
        state = {n: InstanceState.model_validate({"geometry": v.geometry, "capacity": v.capacity}).model_dump()
                 for n, v in self._instances.items()}
        path = self._state_file()
        tmp = path.with_name(f".{STATE_NAME}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(state, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            dfd = os.open(self.data_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)  # the rename itself survives a power cut
            finally:
                os.close(dfd)
        except OSError as exc:
            # A full or read-only data_dir must not stop the daemon from serving; the shares are
            # kept in memory and written again with the next change.
            log.warning("cannot save daemon state to %s: %s", path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> "NodeDaemon":
        """Load the shares, rescan every instance's pools and serve. StorageError when the data
        directory cannot hold the socket (missing permission, read-only file system)."""
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the data directory {self.data_dir}: {exc.strerror or exc}") from None
        for name, ent in self._load_state().items():
            view = _InstanceView(self.config, name, ent.geometry.model_dump(), list(ent.capacity))
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
        if self.config.mooncake_master:
            # Replicas live in Tutti's pools, not in Mooncake Store segments: the master has no part
            # in registering or moving them (docs/CLUSTER.md, "Directory choice").
            log.info("mooncake_master %s is not used by the replica directory (etcd) or the data path",
                     self.config.mooncake_master)
        from tutti_cluster.cluster.directory import local_address_towards

        if self.host is None:
            self.host = local_address_towards(",".join(self.config.etcd))
        slot = max((v.slot_bytes() for v in self._instances.values()), default=0)
        self.transfer = TransferNode(self.host, self.config.protocol, self.arena_bytes, slot_bytes=slot)
        self.stage = StageServer(self.transfer, None, host=self.host, port=self.stage_port,
                                 read_into=self._read_into, check=self._check_unit).start()
        self.directory = EtcdDirectory(",".join(self.config.etcd), self.node_id, self.config.lease_ttl_s,
                                       timeout_s=self.directory_timeout_s)
        with self._lock:
            keys = list(self._index)
        self.directory.register(keys)  # queued until start() has a lease
        self.directory.start(NodeRecord(self.node_id, self.transfer.segment, self.stage.address,
                                        {"pid": os.getpid()}))

    def _start_socket(self) -> None:
        path = socket_path(self.config)
        if path.exists():
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
        self._thread = threading.Thread(target=self._server.serve_forever, name="tutti-daemon", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            try:
                socket_path(self.config).unlink()
            except FileNotFoundError:
                pass
            self._server = None
        if self.directory is not None:
            self.directory.stop(revoke=True)
        if self.stage is not None:
            self.stage.stop()
        for view in self._instances.values():
            view.close()

    # -- index ------------------------------------------------------------------------------------
    def _rescan(self, view: _InstanceView) -> None:
        """Rebuild the index entries of one instance from its pool headers."""
        self._index_instance(view, self._open_view(view))

    def _open_view(self, view: _InstanceView, refuse: tuple[type[TuttiError], ...] = ()) -> list[int]:
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

    def _index_instance(self, view: _InstanceView, keys: list[int]) -> None:
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

    def _fit_slots(self, view: _InstanceView) -> None:
        """Size the staging slots for ``view``'s units (the largest unit of any instance)."""
        if self.transfer is None:
            return
        need = view.slot_bytes()
        if need <= self.transfer.slot_bytes:
            return
        try:
            self.transfer.configure(need)
        except TuttiError as exc:
            # Slots are out (a stream is running) or the arena is too small: units of this instance
            # are misses for other nodes until the next attach resizes the slots.
            log.warning("staging slots stay at %d bytes, instance %s needs %d: %s",
                        self.transfer.slot_bytes, view.name, need, exc)

    def _read_into(self, key: int, view: memoryview) -> int | None:
        """Stage endpoint reader: the unit, from whichever local instance holds it, into a registered slot."""
        with self._lock:
            owners = list(self._index.get(key, ()))
            views = [self._instances[o] for o in owners if o in self._instances]
        self.counters["stage_reads"] += 1
        for v in views:
            try:
                got = v.read_into(key, view)
            except NotFound:
                # Listed but unreadable (overwritten after an eviction we have not heard of yet, or
                # corrupt): stop advertising it so that other nodes do not keep asking.
                self.counters["unreadable_units"] += 1
                self._evict(v.name, [key])
                continue
            if got is not None:
                return got
        return None

    def _check_unit(self, key: int) -> None:
        """A requester found ``key`` corrupt: verify our copies and stop advertising bad ones."""
        with self._lock:
            views = [self._instances[o] for o in self._index.get(key, ()) if o in self._instances]
        for v in views:
            buf = mmap.mmap(-1, max(v.slot_bytes(), mmap.PAGESIZE))  # page-aligned: read in place
            try:
                with memoryview(buf) as view:
                    v.read_into(key, view, verify=True)
            except NotFound:
                self.counters["unreadable_units"] += 1
                self._evict(v.name, [key])
            except TuttiError as exc:
                log.warning("cannot check unit %x of instance %s: %s", key, v.name, exc)
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
        return _HANDLERS[req.op_name()][1](self, req)

    def handle(self, msg: dict[str, Any] | Request) -> dict[str, Any]:
        """One request in process; returns the reply (``ok`` plus fields). Raises TuttiError on bad input."""
        req = msg if isinstance(msg, Request) else parse_request(msg)
        return self._dispatch(req).model_dump(by_alias=True)

    @handles(PingRequest)
    def _ping(self, req: PingRequest) -> Reply:
        return PingReply(node_id=self.node_id)

    @handles(StatsRequest)
    def _stats(self, req: StatsRequest) -> Reply:
        return StatsReply(**self.stats())

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

        The geometry is checked against the instance's pools before anything is stored: one that
        does not describe them (LayoutError, ConfigError) is refused and the old state kept. Pools
        the daemon cannot see (another path, not created yet) are logged, and the share is granted.
        """
        name, geometry = req.instance, req.geometry.model_dump()
        with self._attach_lock:  # one attach at a time: shares and views change together
            with self._lock:
                old = self._instances.get(name)
                if old is None:
                    used = [sum(v.capacity[i] for v in self._instances.values() if i < len(v.capacity))
                            for i in range(len(self.paths))]
                    left = [max(0, c - u) for c, u in zip(self.capacity, used)]
                    want = list(req.capacity) if req.capacity is not None else left
                    if len(want) != len(self.paths):
                        raise ConfigError(f"capacity request has {len(want)} values for {len(self.paths)} paths")
                    grant = [min(r, lft) for r, lft in zip(want, left)]
                    if sum(grant) == 0:
                        raise CapacityExceeded(f"no capacity left on this node for instance {name!r}")
                else:
                    grant = old.capacity
            if old is not None and old.geometry == geometry:
                view = old
                keys = self._open_view(view)
            else:
                view = _InstanceView(self.config, name, geometry, grant)
                keys = self._open_view(view, refuse=(LayoutError, ConfigError))  # raises: nothing stored
            with self._lock:
                self._instances[name] = view
                self._save_state()
                self.counters["attaches"] += 1
            if old is not None and old is not view:
                old.close()
            self._index_instance(view, keys)  # a returning engine may have committed while we were apart
        return AttachReply(paths=self.paths, capacity=view.capacity, node_id=self.node_id)

    def _commit(self, name: str, keys: list[int]) -> None:
        with self._lock:
            for k in keys:
                self._index.setdefault(k, set()).add(name)
            self.counters["commits"] += len(keys)
        if self.directory is not None:
            self.directory.register(keys)

    def _evict(self, name: str, keys: list[int]) -> None:
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
        with self._lock:
            out: dict[str, Any] = {
                "node_id": self.node_id, "units": len(self._index), "paths": self.paths,
                "capacity": self.capacity,
                "instances": {n: {"capacity": v.capacity} for n, v in self._instances.items()},
                **self.counters,
            }
        if self.directory is not None:
            out["directory"] = self.directory.stats.as_dict()
        if self.stage is not None:
            out["stage"] = self.stage.stats.as_dict()
            out["stage_address"] = self.stage.address
            out["segment"] = self.transfer.segment
        return out


def run_daemon(config: TuttiConfig, ready: Callable[[NodeDaemon], None] | None = None) -> None:
    """Run the node daemon until SIGINT or SIGTERM (``tutti up``). ``ready`` is called once it serves."""
    daemon = NodeDaemon(config).start()
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
        daemon.stop()


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

    def __init__(self, config: TuttiConfig, timeout_s: float = 1.0, max_queue: int = 1 << 16,
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

    def attach(self, store: Any) -> dict[str, Any] | None:
        """Announce ``store`` and hook its commit/evict callbacks. None when no daemon answers."""
        geometry = geometry_of(store)
        store.on_commit = lambda k: self._enqueue("commit", k)
        store.on_evict = lambda k: self._enqueue("evict", k)
        return self.attach_geometry(geometry)

    def attach_geometry(self, geometry: dict[str, Any]) -> dict[str, Any] | None:
        """Announce this instance's pools by their geometry (see :func:`geometry_of`); what
        :meth:`attach` does without touching a store's callbacks."""
        self._geometry = geometry
        return self._attach()

    def _attach(self) -> dict[str, Any] | None:
        try:
            return self.request({"op": "attach", "instance": self.config.instance, "geometry": self._geometry,
                                 "capacity": self.config.capacity_bytes()}, timeout_s=self.attach_timeout_s)
        except OSError as exc:
            log.info("no node daemon at %s (%s); the store works alone", self.path, exc)
            return None

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
                    self.request({"op": op, "instance": self.config.instance, "keys": [k for _, k in batch[i:j]]})
                    i = j
            except (OSError, TuttiError) as exc:
                self.dropped += len(batch)
                need_attach = True  # the daemon rescans our headers on re-attach
                log.debug("daemon notification dropped: %s", exc)
            with self._cv:
                self._inflight = 0

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
        self._drop()

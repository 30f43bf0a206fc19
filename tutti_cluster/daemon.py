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
import stat
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Iterator, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from pydantic_core import from_json

from tutti_cluster.config import (INSTANCE_MAX_CHARS, INSTANCE_PATTERN, TuttiConfig, check_instance_name,
                                  validation_summary)
from tutti_cluster.errors import (CapacityExceeded, ConfigError, LayoutError, NotFound, StorageError, TuttiError,
                                  error_class)
from tutti_cluster.files import (MAX_STATE_BYTES, file_kind, group_id, make_dir, read_bounded, socket_mode,
                                  tighten_files, write_atomic)

log = logging.getLogger(__name__)
# How often the node's accept loops (this daemon's, the stage endpoint's) look for a shutdown
# request: stop() waits at most this long (socketserver's default, 0.5 s, made every daemon stop
# take about a second).
SHUTDOWN_POLL_S = 0.05

SOCKET_NAME = "tutti.sock"
STATE_NAME = "instances.json"
PINS_NAME = "pins.json"
# The engines' command channel: how long one ``commands`` request waits for work, how long an
# admin op waits for the engines' results, and how many keys one command carries.
COMMAND_WAIT_MS = 2000
ADMIN_TIMEOUT_S = 10.0
COMMAND_KEYS = 16384
# The daemon's etcd calls give up after DIRECTORY_TIMEOUT_S. A commit or evict notification is
# answered once its keys are (un)registered in etcd, so an engine's link waits longer than that
# (notifications go from a background thread: the engine never waits on them); a link that gave up
# first counted them dropped and re-attached, a rescan of its pools, while etcd was merely slow.
DIRECTORY_TIMEOUT_S = 2.0
LINK_TIMEOUT_S = 5.0
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


# Admin ops (the admin plane, tutti_control): the daemon answers from its index and passes pin,
# unpin and removal commands to the engines that own the units, which take them on their command
# channel (the ``commands`` op) and report the results back.
MAX_ADMIN_KEYS = 65536
KeyPrefix = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{0,16}$")]
AdminKeys = Annotated[list[UnitKey], Field(min_length=1, max_length=MAX_ADMIN_KEYS)]


class ConfigRequest(Request):
    op: Literal["config"] = "config"


class HealthRequest(Request):
    op: Literal["health"] = "health"


class ObjectsRequest(Request):
    """Units by key, or by hex prefix of their 16-digit key ('' matches all), at most ``limit``."""

    op: Literal["objects"] = "objects"
    keys: AdminKeys | None = None
    prefix: KeyPrefix | None = None
    limit: Annotated[int, Field(gt=0, le=1 << 20)] = 1000

    @model_validator(mode="after")
    def _one(self) -> "ObjectsRequest":
        if (self.keys is None) == (self.prefix is None):
            raise ValueError("give keys or prefix, exactly one")
        return self


class RemoveUnitsRequest(Request):
    """Evict units (never pinned ones): by key, by hex prefix, or all."""

    op: Literal["remove_units"] = "remove_units"
    keys: AdminKeys | None = None
    prefix: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{1,16}$")] | None = None
    all: bool = False

    @model_validator(mode="after")
    def _one(self) -> "RemoveUnitsRequest":
        if sum((self.keys is not None, self.prefix is not None, self.all)) != 1:
            raise ValueError("give keys, prefix or all, exactly one")
        return self


class PinRequest(Request):
    op: Literal["pin"] = "pin"
    keys: AdminKeys


class UnpinRequest(Request):
    op: Literal["unpin"] = "unpin"
    keys: AdminKeys


class PinsRequest(Request):
    op: Literal["pins"] = "pins"


class DrainRequest(Request):
    """Stop taking new units; ``mode`` says what to evict (see NodeDaemon._drain_op)."""

    op: Literal["drain"] = "drain"
    mode: Literal["replicated", "all", "none"] = "replicated"


class UndrainRequest(Request):
    op: Literal["undrain"] = "undrain"


class CommandResult(_Model):
    """What an engine did with one admin command: keys done, absent from its store, skipped (pinned
    units a removal leaves, keys an unpin found unpinned)."""

    id: Annotated[int, Field(gt=0)]
    done: list[UnitKey] = []
    absent: list[UnitKey] = []
    skipped: list[UnitKey] = []
    error: Annotated[str, StringConstraints(max_length=1000)] | None = None


# An engine's counters: finite numbers, and text only where a counter is a name (the store's
# backend); the daemon and the admin plane do arithmetic on the rest.
_Number = Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | Annotated[float, Field(allow_inf_nan=False)]
TEXT_STATS = frozenset({"backend"})


def _stats_dict(value: dict[str, Any] | None) -> dict[str, Any] | None:
    for k, v in (value or {}).items():
        if isinstance(v, str) and k not in TEXT_STATS:
            raise ValueError(f"counter {k!r} must be a number, not text")
    return value


_Stats = Annotated[dict[str, _Number | bool | Annotated[str, StringConstraints(max_length=200)]],
                   Field(max_length=256), AfterValidator(_stats_dict)]


class CommandsRequest(Request):
    """The engine's command channel: results of the commands it took last, its store's counters,
    and a wait of up to ``wait_ms`` for new commands."""

    op: Literal["commands"] = "commands"
    instance: InstanceName
    wait_ms: Annotated[int, Field(ge=0, le=30000)] = 2000
    results: Annotated[list[CommandResult], Field(max_length=4096)] = []
    stats: _Stats | None = None
    cluster: _Stats | None = None
    queued: Annotated[int, Field(ge=0)] = 0


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


class ConfigReply(Reply):
    node_id: str
    config: dict[str, Any]


class HealthReply(Reply):
    node_id: str
    cluster_mode: bool
    etcd: bool | None


class ObjectsReply(Reply):
    node_id: str
    objects: list[dict[str, Any]]
    truncated: bool


class RemoveUnitsReply(Reply):
    evicted: int
    pinned_kept: int
    unreachable: int


class PinReply(Reply):
    pinned: list[int]
    absent: list[int]
    unreachable: list[int]


class UnpinReply(Reply):
    unpinned: list[int]
    not_pinned: list[int]
    unreachable: list[int]


class PinsReply(Reply):
    keys: list[int]


class DrainReply(Reply):
    drain: dict[str, Any]


class CommandsReply(Reply):
    commands: list[dict[str, Any]]


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
                st = TuttiStore(self.config)
                st.open_pools(num_layers=g["num_layers"], objs_per_layer=g["nptr"], block_bytes=g["block_bytes"],
                              block_tokens=g["block_tokens"], dtype=g.get("dtype", ""),
                              block_shape=tuple(g.get("block_shape", ())))
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

    def holds(self, key: int, since: float) -> bool:
        """Whether the pool headers hold ``key``, as of a rescan no older than ``since`` (monotonic)."""
        if self.refreshed_at < since and not self._refresh(since):
            return True  # cannot tell: the rescan failed (logged), so do not drop the unit
        with self._shared() as st:
            return st is not None and bool(st.contains(key))

    def slot_bytes(self) -> int:
        with self._shared() as st:
            return int(st.geometry()["slot_bytes"]) if st is not None else 0

    def stats(self) -> dict[str, Any]:
        """The read-only store's counters (units and slots as the pool headers show them)."""
        with self._shared() as st:
            return dict(st.stats()) if st is not None else {}

    def close(self) -> None:
        with self._alone():
            st, self.store = self.store, None
        if st is not None:
            st.close()


class NodeDaemon:
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
        self._lock = threading.RLock()
        self._attach_locks: dict[str, threading.Lock] = {}  # one per instance name (see _attach)
        self._reserved: dict[str, list[int]] = {}  # shares granted to attaches still opening their pools
        self._slots_lock = threading.Lock()
        self._instances: dict[str, _InstanceView] = {}
        self._index: dict[int, set[str]] = {}
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket bound: removed at stop
        self._thread: threading.Thread | None = None
        self.directory: Any = None
        self.transfer: Any = None
        self.stage: Any = None
        self.counters = {"commits": 0, "evictions": 0, "lookups": 0, "attaches": 0, "stage_reads": 0,
                         "unreadable_units": 0}
        # Admin plane (docs/ADMIN.md). ``advertise`` goes into the node's cluster record (the admin
        # API's address). Commands wait per instance until its engine takes them on its command
        # channel; ``_waiting`` are the ids an admin op waits for, ``_results`` their answers.
        self.advertise = dict(advertise or {})
        self._cmd_cv = threading.Condition()  # never taken while holding _lock
        self._commands: dict[str, list[dict[str, Any]]] = {}
        self._waiting: set[int] = set()
        self._results: dict[int, dict[str, Any]] = {}
        self._next_command = 0
        self._engines: dict[str, dict[str, Any]] = {}
        self._pins: set[int] = set()
        self._drain: dict[str, Any] | None = None
        self._drain_thread: threading.Thread | None = None
        self._stopping = False

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
        state = {n: InstanceState.model_validate({"geometry": v.geometry, "capacity": v.capacity}).model_dump()
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

    def _drop_unreadable(self, v: _InstanceView, key: int, why: str) -> None:
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
        # One attach of an instance at a time; other instances' attaches run beside it (the engines
        # of a node start together, and opening large pools takes a while): a new instance's share
        # is reserved while its pools open, so that shares granted at once never add up past the node.
        with self._lock:
            attach_lock = self._attach_locks.setdefault(name, threading.Lock())
        with attach_lock:
            with self._lock:
                old = self._instances.get(name)
                if old is None:
                    shares = [*(v.capacity for v in self._instances.values()), *self._reserved.values()]
                    used = [sum(c[i] for c in shares if i < len(c)) for i in range(len(self.paths))]
                    left = [max(0, c - u) for c, u in zip(self.capacity, used)]
                    want = list(req.capacity) if req.capacity is not None else left
                    if len(want) != len(self.paths):
                        raise ConfigError(f"capacity request has {len(want)} values for {len(self.paths)} paths")
                    grant = [min(r, lft) for r, lft in zip(want, left)]
                    if sum(grant) == 0:
                        raise CapacityExceeded(f"no capacity left on this node for instance {name!r}")
                    if self._drain is not None:
                        raise CapacityExceeded(f"node {self.node_id} is draining: it takes no new instance ({name!r})")
                    self._reserved[name] = grant
                else:
                    grant = old.capacity
            try:
                if old is not None and old.geometry == geometry:
                    view = old
                    keys = self._open_view(view)
                else:
                    view = _InstanceView(self.config, name, geometry, grant)
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
        return AttachReply(paths=self.paths, capacity=view.capacity, node_id=self.node_id)

    def _commit(self, name: str, keys: list[int]) -> None:
        with self._lock:
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

    # -- admin plane ------------------------------------------------------------------------------
    # Units belong to the engines' stores (the daemon only reads their pools), so pins and
    # removals are commands the daemon queues per instance; each engine's DaemonLink takes them on
    # its command channel (``commands``), applies them to its own store and reports the results on
    # its next request. An engine that is not connected cannot act: its keys are "unreachable".

    def _load_pins(self) -> set[int]:
        path = self.data_dir / PINS_NAME
        try:
            data = from_json(read_bounded(path, MAX_STATE_BYTES, what="pins"), allow_inf_nan=False)
            if not isinstance(data, list) or not all(isinstance(k, int) and 0 <= k <= _U64 for k in data):
                raise ValueError("not a list of unit keys")
            return set(data)
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, StorageError) as exc:
            log.warning("pins %s unreadable (%s): starting with no pins", path, exc)
            return set()

    def _save_pins(self) -> None:
        path = self.data_dir / PINS_NAME
        with self._lock:
            keys = sorted(self._pins)
        try:
            write_atomic(path, json.dumps(keys).encode(), self._file_gid)  # the old or the new list, never a torn one
        except OSError as exc:
            log.warning("cannot save pins to %s: %s", path, exc)

    def _engine_live(self, name: str) -> bool:
        """Whether ``name``'s engine polls its command channel (call with _cmd_cv held)."""
        e = self._engines.get(name)
        # A live link polls again as soon as a poll returns: a gap of 3 s means the engine is gone,
        # unless the poll handed it commands; it polls again once it has applied them (the results
        # come with that poll), which may take up to ADMIN_TIMEOUT_S, the wait for those results.
        return e is not None and (e["polling"] > 0 or time.monotonic() - e["seen"] < 3.0
                                  or time.monotonic() < e["applying_until"])

    def _owners_of(self, keys: list[int]) -> dict[str, list[int]]:
        """Local instances holding each key: instance -> its keys, in the order given."""
        out: dict[str, list[int]] = {}
        with self._lock:
            for k in keys:
                for name in sorted(self._index.get(k, ())):
                    out.setdefault(name, []).append(k)
        return out

    def _queue_commands(self, name: str, cmds: list[dict[str, Any]]) -> list[int]:
        """Queue commands for ``name``'s engine (call with _cmd_cv held); their ids."""
        ids = []
        q = self._commands.setdefault(name, [])
        for c in cmds:
            self._next_command += 1
            q.append({"id": self._next_command, **c})
            ids.append(self._next_command)
        self._cmd_cv.notify_all()
        return ids

    def _run_commands(self, cmds: dict[str, list[dict[str, Any]]],
                      timeout_s: float = ADMIN_TIMEOUT_S) -> dict[str, list[dict[str, Any] | None]]:
        """Send commands to the engines and wait for their results: per instance, one result per
        command, None where its engine is not connected or did not answer within ``timeout_s``
        (a command no engine took by then is withdrawn)."""
        ids: dict[str, list[int]] = {}
        with self._cmd_cv:
            for name, lst in cmds.items():
                if lst and self._engine_live(name):
                    ids[name] = self._queue_commands(name, lst)
            want = {i for lst in ids.values() for i in lst}
            self._waiting |= want
            self._cmd_cv.wait_for(lambda: want <= self._results.keys() or self._stopping, timeout_s)
            out: dict[str, list[dict[str, Any] | None]] = {}
            for name, lst in cmds.items():
                got = ids.get(name)
                out[name] = [self._results.pop(i, None) for i in got] if got else [None] * len(lst)
            self._waiting -= want
            for name in ids:
                if self._commands.get(name):
                    self._commands[name] = [c for c in self._commands[name] if c["id"] not in want]
        return out

    @handles(CommandsRequest)
    def _commands_op(self, req: CommandsRequest) -> Reply:
        self._known(req.instance)
        name, now = req.instance, time.monotonic()
        sync: list[dict[str, Any]] | None = None
        with self._cmd_cv:
            e = self._engines.setdefault(name, {"seen": now, "polling": 0, "synced": False, "stats": None,
                                                "base": None, "rates": {}, "cluster": None, "queued": 0,
                                                "applying_until": 0.0})
            synced = e["synced"]
        if not synced:
            sync = self._sync_commands(name)  # reads _lock: not under _cmd_cv
        with self._cmd_cv:
            if req.stats is not None:
                self._rate(e, dict(req.stats), now)
            if req.cluster is not None:
                e["cluster"] = dict(req.cluster)
            e["queued"], e["seen"] = req.queued, now
            for r in req.results:
                if r.id in self._waiting:
                    self._results[r.id] = r.model_dump()
            if req.results:
                self._cmd_cv.notify_all()
            if sync is not None and not e["synced"]:
                e["synced"] = True
                self._queue_commands(name, sync)  # nobody waits for these results
            e["polling"] += 1
            try:
                self._cmd_cv.wait_for(lambda: bool(self._commands.get(name)) or self._stopping, req.wait_ms / 1000)
            finally:
                e["polling"] -= 1
            cmds = self._commands.pop(name, [])
            e["seen"] = time.monotonic()
            e["applying_until"] = e["seen"] + ADMIN_TIMEOUT_S if cmds else 0.0
        return CommandsReply(commands=cmds)

    def _sync_commands(self, name: str) -> list[dict[str, Any]]:
        """What a newly connected engine must apply: the pins of its units, the drain state."""
        with self._lock:
            pinned = [k for k in sorted(self._pins) if name in self._index.get(k, ())]
            draining = self._drain is not None
        cmds = [{"cmd": "pin", "keys": pinned[i:i + COMMAND_KEYS]} for i in range(0, len(pinned), COMMAND_KEYS)]
        return cmds + [{"cmd": "drain", "on": draining}]

    @staticmethod
    def _rate(e: dict[str, Any], stats: dict[str, Any], now: float) -> None:
        """Read and write bandwidth over the last >= 1 s between two reports of an engine."""
        e["stats"] = stats
        base = e["base"]
        if base is None:
            e["base"] = (now, stats)
            return
        t0, s0 = base
        if now - t0 >= 1.0:
            dt = now - t0
            e["rates"] = {f"{k}_bytes_per_s": max(0, int(stats.get(f, 0)) - int(s0.get(f, 0))) / dt
                          for k, f in (("read", "bytes_read"), ("write", "bytes_written"))}
            e["base"] = (now, stats)

    @handles(ConfigRequest)
    def _config_op(self, req: ConfigRequest) -> Reply:
        return ConfigReply(node_id=self.node_id, config=self.config.model_dump(mode="json"))  # secrets come out masked

    @handles(HealthRequest)
    def _health_op(self, req: HealthRequest) -> Reply:
        etcd = None
        if self.directory is not None:
            try:
                self.directory.client.count_prefix(b"tutti/n/")
                etcd = True
            except Exception as exc:  # any etcd or channel failure: not ready
                log.debug("etcd health check failed: %s", exc)
                etcd = False
        return HealthReply(node_id=self.node_id, cluster_mode=self.config.cluster_mode, etcd=etcd)

    @staticmethod
    def _prefix_range(prefix: str) -> tuple[int, int]:
        shift = 4 * (16 - len(prefix))
        lo = int(prefix, 16) << shift if prefix else 0
        return lo, lo + (1 << shift)

    @handles(ObjectsRequest)
    def _objects_op(self, req: ObjectsRequest) -> Reply:
        with self._lock:
            if req.keys is not None:
                keys = list(dict.fromkeys(req.keys))
            else:
                lo, hi = self._prefix_range(req.prefix or "")
                keys = sorted(k for k in self._index if lo <= k < hi)
            truncated = len(keys) > req.limit
            keys = keys[:req.limit]
            objs = [{"key": k, "instances": sorted(self._index.get(k, ())), "pinned": k in self._pins, "remote": []}
                    for k in keys]
        if self.directory is not None and keys:
            for o, owners in zip(objs, self.directory.lookup(keys, prefix=False)):
                o["remote"] = owners
        return ObjectsReply(node_id=self.node_id, objects=objs, truncated=truncated)

    @handles(RemoveUnitsRequest)
    def _remove_units_op(self, req: RemoveUnitsRequest) -> Reply:
        with self._lock:
            if req.keys is not None:
                keys = [k for k in dict.fromkeys(req.keys) if k in self._index]
            elif req.prefix is not None:
                lo, hi = self._prefix_range(req.prefix)
                keys = [k for k in self._index if lo <= k < hi]
            else:
                keys = list(self._index)
        evicted, kept, unreachable = self._remove(keys)
        return RemoveUnitsReply(evicted=evicted, pinned_kept=kept, unreachable=unreachable)

    def _remove(self, keys: list[int]) -> tuple[int, int, int]:
        """Evict ``keys`` from every local store holding them, pinned ones excepted: (evicted, kept
        because pinned, left because their engine did not answer)."""
        with self._lock:
            kept = {k for k in keys if k in self._pins}
        todo = [k for k in keys if k not in kept]
        by_inst = self._owners_of(todo)
        chunks = {n: [ks[i:i + COMMAND_KEYS] for i in range(0, len(ks), COMMAND_KEYS)] for n, ks in by_inst.items()}
        cmds: dict[str, list[dict[str, Any]]] = {n: [{"cmd": "remove", "keys": c} for c in cs] for n, cs in chunks.items()}
        unreachable: set[int] = set()
        for name, results in self._run_commands(cmds).items():
            for chunk, r in zip(chunks[name], results):
                if r is None or r.get("error"):
                    unreachable.update(chunk)
                    continue
                kept.update(r["skipped"])
                # Gone from the store (or already absent: our index was behind): gone from the index
                # now, before the engine's own eviction notice arrives.
                self._evict(name, list(r["done"]) + list(r["absent"]), count=False)
        return len([k for k in todo if k not in unreachable and k not in kept]), len(kept), len(unreachable - kept)

    def _key_command(self, cmd: str, keys: list[int]) -> tuple[set[int], set[int]]:
        """Sends ``cmd`` for ``keys`` to each engine owning some of them: (keys it did, keys whose
        engine did not answer or refused)."""
        by_inst = self._owners_of(keys)
        results = self._run_commands({n: [{"cmd": cmd, "keys": ks}] for n, ks in by_inst.items()})
        done: set[int] = set()
        unreachable: set[int] = set()
        for name, ks in by_inst.items():
            r = results[name][0]
            if r is None or r.get("error"):
                unreachable.update(ks)
            else:
                done.update(r["done"])
        return done, unreachable

    @handles(PinRequest)
    def _pin_op(self, req: PinRequest) -> Reply:
        keys = list(dict.fromkeys(req.keys))
        pinned, unreachable = self._key_command("pin", keys)
        unreachable -= pinned  # pinned where its engine answered; the others follow when they connect
        if pinned:
            with self._lock:
                self._pins |= pinned
            self._save_pins()
        return PinReply(pinned=[k for k in keys if k in pinned], unreachable=[k for k in keys if k in unreachable],
                        absent=[k for k in keys if k not in pinned and k not in unreachable])

    @handles(UnpinRequest)
    def _unpin_op(self, req: UnpinRequest) -> Reply:
        keys = list(dict.fromkeys(req.keys))
        done, unreachable = self._key_command("unpin", keys)
        with self._lock:
            was = self._pins & set(keys)
            self._pins -= set(keys) - unreachable  # a pin whose engine is away stays recorded
        if was:
            self._save_pins()
        unpinned = (was | done) - unreachable
        return UnpinReply(unpinned=[k for k in keys if k in unpinned], unreachable=[k for k in keys if k in unreachable],
                          not_pinned=[k for k in keys if k not in unpinned and k not in unreachable])

    @handles(PinsRequest)
    def _pins_op(self, req: PinsRequest) -> Reply:
        with self._lock:
            return PinsReply(keys=sorted(self._pins))

    @handles(DrainRequest)
    def _drain_op(self, req: DrainRequest) -> Reply:
        """Drain: no new instances, every engine removes the units it commits from now on (so the
        node takes no new units) and keeps serving reads. ``replicated`` evicts each unit once
        another node holds it (checked now and every 2 s), ``all`` evicts every unpinned unit, ``none``
        evicts nothing. Drained when no unit is left."""
        with self._lock:
            if self._drain is None:
                self._drain = {"mode": req.mode, "started_at": time.time(), "replicated_elsewhere": None}
            else:
                self._drain["mode"] = req.mode
            names = list(self._instances)
        with self._cmd_cv:
            live = [n for n in names if self._engine_live(n)]
        self._run_commands({n: [{"cmd": "drain", "on": True}] for n in live})
        self._drain_step()
        if self._drain_thread is None or not self._drain_thread.is_alive():
            self._drain_thread = threading.Thread(target=self._drain_loop, name="tutti-drain", daemon=True)
            self._drain_thread.start()
        return DrainReply(drain=self.drain_status())

    @handles(UndrainRequest)
    def _undrain_op(self, req: UndrainRequest) -> Reply:
        with self._lock:
            self._drain = None
            names = list(self._instances)
        with self._cmd_cv:
            live = [n for n in names if self._engine_live(n)]
        self._run_commands({n: [{"cmd": "drain", "on": False}] for n in live})
        return DrainReply(drain=self.drain_status())

    def _drain_step(self) -> None:
        with self._lock:
            d = self._drain
            keys = list(self._index)
            unpinned = [k for k in keys if k not in self._pins]
        if d is None:
            return
        if d["mode"] == "all":
            self._remove(unpinned)
        elif self.directory is not None:
            owners = self.directory.lookup(keys, prefix=False) if keys else []
            elsewhere = [k for k, o in zip(keys, owners) if o]
            if d["mode"] == "replicated":
                self._remove(elsewhere)  # pinned ones stay
            with self._lock:
                if self._drain is d:  # of the units left, those another node holds too
                    d["replicated_elsewhere"] = sum(1 for k in elsewhere if k in self._index)

    def _drain_loop(self) -> None:
        while True:
            with self._cmd_cv:
                self._cmd_cv.wait_for(lambda: self._stopping, 2.0)
                if self._stopping:
                    return
            with self._lock:
                if self._drain is None:
                    return
            try:
                self._drain_step()
            except Exception:  # keep draining; the next step tries again
                log.exception("drain step failed")

    def drain_status(self) -> dict[str, Any]:
        with self._lock:
            d = self._drain
            units = len(self._index)
            pinned = len(self._pins & self._index.keys())
        if d is None:
            return {"state": "serving", "mode": None, "units_left": units, "replicated_elsewhere": None,
                    "pinned_left": pinned, "started_at": None}
        return {"state": "drained" if units == 0 else "draining", "mode": d["mode"], "units_left": units,
                "replicated_elsewhere": d["replicated_elsewhere"], "pinned_left": pinned,
                "started_at": d["started_at"]}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "node_id": self.node_id, "units": len(self._index), "paths": self.paths,
                "capacity": self.capacity, "cluster_mode": self.config.cluster_mode, "pins": len(self._pins),
                "instances": {n: {"capacity": v.capacity} for n, v in self._instances.items()},
                **self.counters,
            }
            views = dict(self._instances)
            held = dict.fromkeys(views, 0)
            for owners in self._index.values():
                for name in owners:
                    if name in held:
                        held[name] += 1
        for name, ent in out["instances"].items():
            view = views[name].stats()
            if view:
                # Units and slots as the index has them: it follows every commit and eviction the
                # engines report, while the view counts what its last rescan of the headers found.
                view["units"] = held[name]
                view["free_slots"] = max(0, int(view.get("total_slots", 0)) - held[name])
            ent["view"] = view
        with self._cmd_cv:
            for name, ent in out["instances"].items():
                e = self._engines.get(name) or {}
                ent.update(engine=e.get("stats"), engine_connected=self._engine_live(name), rates=e.get("rates", {}),
                           cluster=e.get("cluster"), notification_queue=e.get("queued", 0),
                           command_queue=len(self._commands.get(name, ())))
        out["drain"] = self.drain_status()
        if self.directory is not None:
            out["directory"] = self.directory.stats.as_dict()
        if self.stage is not None:
            out["stage"] = self.stage.stats.as_dict()
            out["stage_address"] = self.stage.address
            out["segment"] = self.transfer.segment
        return out


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
            reply = self.request({"op": "attach", "instance": self.config.instance, "geometry": self._geometry,
                                  "capacity": self.config.capacity_bytes()}, timeout_s=self.attach_timeout_s)
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
                    self.request({"op": op, "instance": self.config.instance, "keys": [k for _, k in batch[i:j]]})
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
        results: list[dict[str, Any]] = []
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
                msg: dict[str, Any] = {"op": "commands", "instance": self.config.instance, "wait_ms": COMMAND_WAIT_MS,
                                       "results": results, "queued": len(self._queue), "stats": self._store_stats()}
                if self.cluster_stats is not None:
                    msg["cluster"] = {k: v for k, v in self.cluster_stats().items() if isinstance(v, (int, float))}
                self._cmd_sock.sendall(json.dumps(msg).encode() + b"\n")
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
                for cmd in reply["commands"]:
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

    def _apply(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One admin command on the store: pins are the link's own (one store pin per key, however
        often it is pinned), removals leave pinned units in place."""
        cid, kind = int(cmd["id"]), cmd.get("cmd")
        keys = [int(k) for k in cmd.get("keys", ())]
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
                done, absent = present, [k for k in keys if k not in self._pinned]
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
                self.draining = bool(cmd.get("on"))
            else:
                return {"id": cid, "error": f"unknown admin command {kind!r}"}
        except TuttiError as exc:
            return {"id": cid, "done": done, "absent": absent, "skipped": skipped, "error": str(exc)[:1000]}
        self.commands_applied += 1
        return {"id": cid, "done": done, "absent": absent, "skipped": skipped}

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

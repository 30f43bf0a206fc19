"""The node daemon's protocol: every request and reply as a pydantic model, and the socket's constants.

Both sides import this module and nothing of the other: the daemon (:mod:`tutti_cluster.node.daemon`)
validates each request with its op's model, the engines' client (:mod:`tutti_cluster.node.link`) and
the admin plane send them.

The socket is ``<data_dir>/tutti.sock`` (:func:`socket_path`). Each request is one JSON object on
one line, validated by the pydantic model of its ``op`` (one :class:`Request` subclass per op, listed
in :data:`REQUESTS`; the daemon has one handler per op: a new op is a model plus a method). Each reply
is one line: ``{"ok": true, ...}`` or, for anything refused,
``{"ok": false, "error": {"class": "<TuttiError subclass>", "message": "..."}}`` (:class:`ErrorReply`).
Malformed lines (not UTF-8, not JSON, not an object, unknown op, wrong field types, non-finite or
out-of-range numbers, nesting deeper than the parser's limit, longer than :data:`MAX_LINE`) get that
error reply and the connection reads on. :class:`~tutti_cluster.node.link.DaemonLink` raises the
error's class on the engine side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, StringConstraints,
                      ValidationError, field_validator, model_serializer, model_validator)
from pydantic_core import from_json

from tutti_cluster.config import INSTANCE_MAX_CHARS, INSTANCE_PATTERN, TuttiConfig, validation_summary
from tutti_cluster.errors import ConfigError, TuttiError, error_class
# How often the node's accept loops (this daemon's, the stage endpoint's) look for a shutdown
# request: stop() waits at most this long (socketserver's default, 0.5 s, made every daemon stop
# take about a second).
SHUTDOWN_POLL_S = 0.05

SOCKET_NAME = "tutti.sock"
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
U64 = (1 << 64) - 1
I63 = (1 << 63) - 1
InstanceName = Annotated[str, StringConstraints(pattern=f"^{INSTANCE_PATTERN}$", max_length=INSTANCE_MAX_CHARS)]
UnitKey = Annotated[int, Field(ge=0, le=U64)]
_Positive = Annotated[int, Field(gt=0, le=I63)]


class StrictModel(BaseModel):
    # strict: a key is an int, not "7", 7.0 or true; extra fields are mistakes.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Geometry(StrictModel):
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


class Request(StrictModel):
    """Base of every daemon request. A subclass per op, with ``op: Literal["<name>"] = "<name>"``."""

    op: str

    @classmethod
    def op_name(cls) -> str:
        return str(cls.model_fields["op"].default)


_Shares = Annotated[list[Annotated[int, Field(ge=0, le=I63)]], Field(min_length=1, max_length=256)]


class AttachRequest(Request):
    """An instance announces its geometry; ``capacity`` (bytes per path) is what it asks for,
    absent for whatever is left. ``memory_capacity`` (bytes per memory path) is its memory tier's,
    absent when it has none."""

    op: Literal["attach"] = "attach"
    instance: InstanceName
    geometry: Geometry
    capacity: _Shares | None = None
    memory_capacity: _Shares | None = None

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


# A pin's tier: ``any`` protects the unit wherever it lies; ``memory`` also copies it into the
# memory tier (a pinned unit's memory copy is never demoted, whatever its tier).
PinTier = Literal["any", "memory"]
# Where a unit lies (``TuttiStore.unit_tiers``): in memory only (not yet durable), on storage only,
# in both; "" absent.
UnitTier = Literal["memory", "storage", "both", ""]


class PinRequest(Request):
    op: Literal["pin"] = "pin"
    keys: AdminKeys
    tier: PinTier = "any"


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


class CommandResult(StrictModel):
    """What an engine did with one admin command: keys done, absent from its store, skipped (pinned
    units a removal leaves, keys an unpin found unpinned, keys a memory pin pinned in a store with
    no memory tier); for ``tiers``, each key's tier in its store."""

    id: Annotated[int, Field(gt=0)]
    done: list[UnitKey] = []
    absent: list[UnitKey] = []
    skipped: list[UnitKey] = []
    tiers: list[UnitTier] = []
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
    """The instance's share: bytes of each storage path, and of each memory path ([] where the
    instance or the node has no memory tier)."""

    paths: list[str]
    capacity: list[int]
    node_id: str
    memory_paths: list[str] = []
    memory_capacity: list[int] = []


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
    objects: list[UnitInfo]
    truncated: bool


class RemoveUnitsReply(Reply):
    evicted: int
    pinned_kept: int
    unreachable: int


class PinReply(Reply):
    """``no_memory_tier``: of ``pinned`` (a memory pin), the keys an engine holding them could not
    put in memory: its store has no memory tier (the pin protects them where they lie)."""

    pinned: list[int]
    absent: list[int]
    unreachable: list[int]
    no_memory_tier: list[int] = []


class UnpinReply(Reply):
    unpinned: list[int]
    not_pinned: list[int]
    unreachable: list[int]


class PinsReply(Reply):
    """Every pinned key; ``memory``: those pinned with tier ``memory`` (the others' tier is ``any``)."""

    keys: list[int]
    memory: list[int] = []


class UnitInfo(BaseModel):
    """One unit of an ``objects`` reply: the local instances holding it, other nodes holding it, and
    its tier in each local instance that could tell (see ``AdminOps._tiers``)."""

    model_config = ConfigDict(extra="forbid")
    key: int
    instances: list[str]
    pinned: bool
    remote: list[str]
    tiers: dict[str, UnitTier] = {}


class DrainState(BaseModel):
    """The node's drain (see the daemon's ``_drain_op``)."""

    model_config = ConfigDict(extra="forbid")
    state: Literal["serving", "draining", "drained"]
    mode: Literal["replicated", "all", "none"] | None
    units_left: int
    replicated_elsewhere: int | None
    pinned_left: int
    started_at: float | None


class DrainReply(Reply):
    drain: DrainState


class _GivenFields(BaseModel):
    """Serialized with the fields it was given only (and any extra ones), as the dict it replaces."""

    @model_serializer(mode="wrap")
    def _given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        given = self.model_fields_set | set(self.model_extra or ())
        return {k: v for k, v in handler(self).items() if k in given}


class Command(_GivenFields):
    """An admin command for an engine's store: ``pin`` (``memory``: and copy into the memory tier),
    ``unpin`` or ``remove`` its ``keys``, ``tiers`` (where each of ``keys`` lies), or ``drain``
    (``on``: stop or go on taking new units)."""

    model_config = ConfigDict(extra="forbid")
    id: int = 0
    cmd: str
    keys: list[int] = []
    on: bool = False
    memory: bool = False


class CommandsReply(Reply):
    commands: list[Command]


class _Counters(_GivenFields):
    """Counters read by name; any other counter of the report is carried along as it came."""

    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="before")
    @classmethod
    def _whole(cls, v: Any) -> Any:
        # A report's counters are finite numbers (CommandsRequest): those read by name are counts.
        return int(v) if isinstance(v, (bool, float)) else v

    def empty(self) -> bool:
        """Nothing reported (the reporter could not read its counters)."""
        return not self.model_fields_set and not self.model_extra


class StoreCounters(_Counters):
    """An engine store's counters (``TuttiStore.stats()``; the engine adds its own, e.g. the vLLM
    connector's lookups and hits), as the daemon reports them and the admin plane reads them."""

    units: int = 0  # both tiers, as are the slots
    pinned: int = 0
    total_slots: int = 0
    free_slots: int = 0
    slot_bytes: int = 0
    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    bytes_read: int = 0  # both tiers
    bytes_written: int = 0
    checksum_failures: int = 0
    io_errors: int = 0
    # The memory tier (all zero without one): units with a copy there and its slots; lookup hits
    # whose fastest copy is in memory or only in storage; bytes read from memory; storage copies
    # taken into memory and memory copies dropped for room; units copied to storage, their bytes,
    # the copies that failed, and the units in memory only, waiting for their storage copy.
    memory_units: int = 0
    memory_slots: int = 0
    memory_free_slots: int = 0
    memory_hits: int = 0
    storage_hits: int = 0
    memory_bytes_read: int = 0
    promotions: int = 0
    demotions: int = 0
    flushes: int = 0
    flush_bytes: int = 0
    flush_errors: int = 0
    flush_backlog: int = 0


class RemoteCounters(_Counters):
    """An engine's fetches from other nodes (``ClusterClient.stats``)."""

    remote_units: int = 0
    remote_bytes: int = 0
    remote_failures: int = 0


class StageCounters(_Counters):
    """What this node's stage endpoint served to other nodes (``StageStats``)."""

    units_staged: int = 0
    bytes_staged: int = 0
    misses: int = 0


class DirectoryCounters(_Counters):
    """The cluster directory's counters (``DirectoryStats``)."""

    lookup_errors: int = 0
    put_errors: int = 0


class Rates(_GivenFields):
    """An engine's read and write bandwidth over its last >= 1 s between two reports (none before)."""

    model_config = ConfigDict(extra="forbid")
    read_bytes_per_s: float = 0.0
    write_bytes_per_s: float = 0.0


class InstanceStats(BaseModel):
    """One instance in the ``stats`` reply."""

    model_config = ConfigDict(extra="forbid")
    capacity: list[int]
    memory_capacity: list[int] = []  # its share of each memory path ([]: no memory tier)
    view: StoreCounters  # the daemon's read-only view of its pools; units and slots as the index has them
    engine: StoreCounters | None  # the engine's last report; None before its first
    engine_connected: bool
    rates: Rates
    cluster: RemoteCounters | None
    notification_queue: int
    command_queue: int

    def occupancy(self) -> StoreCounters:
        """Units and slots: the engine's own store when it reports (current), else the daemon's
        read-only view of its pool headers (as of the last rescan)."""
        eng = self.engine
        return eng if self.engine_connected and eng is not None and not eng.empty() else self.view


# Present in cluster mode only.
_CLUSTER_STATS = ("directory", "stage", "stage_address", "segment")


class StatsReply(Reply):
    """The node's counters: its index, the daemon's own counters, each instance, the drain, and in
    cluster mode the directory and the stage endpoint."""

    node_id: str
    units: int
    paths: list[str]
    capacity: list[int]
    memory_paths: list[str] = []
    memory_capacity: list[int] = []
    cluster_mode: bool
    pins: int
    instances: dict[str, InstanceStats]
    commits: int
    evictions: int
    lookups: int
    attaches: int
    stage_reads: int
    unreadable_units: int
    drain: DrainState
    directory: DirectoryCounters | None = None
    stage: StageCounters | None = None
    stage_address: str | None = None
    segment: str | None = None

    @model_serializer(mode="wrap")
    def _single_node(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        for k in _CLUSTER_STATS:
            if out.get(k) is None:
                out.pop(k, None)
        return out


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



# op name -> its request model: every op the daemon answers.
REQUESTS: dict[str, type[Request]] = {m.op_name(): m for m in (
    AttachRequest, CommitRequest, EvictRequest, LookupRequest, StatsRequest, PingRequest, ConfigRequest,
    HealthRequest, ObjectsRequest, RemoveUnitsRequest, PinRequest, UnpinRequest, PinsRequest, DrainRequest,
    UndrainRequest, CommandsRequest)}

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
    model = REQUESTS.get(op) if isinstance(op, str) else None
    if model is None:
        shown = repr(op) if isinstance(op, str) and len(op) <= 64 else type(op).__name__
        raise ConfigError(f"unknown daemon request {shown}; known: {', '.join(sorted(REQUESTS))}")
    try:
        return model.model_validate(msg)
    except ValidationError as e:
        raise ConfigError(f"bad {op} request: {validation_summary(e)}") from None


_Q = TypeVar("_Q", bound=Request)


def make_request(model: type[_Q], **fields: Any) -> _Q:
    """A client's request, validated as the daemon validates it: ConfigError if bad."""
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        raise ConfigError(f"bad {model.op_name()} request: {validation_summary(e)}") from None


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

"""Request and response bodies of the admin API (pydantic; the OpenAPI schema is built from them).

Keys travel as 16 hex digits (the 64-bit unit key, as the cluster directory writes it under
``tutti/u/``); key prefixes are 0-16 hex digits, so a prefix can never name a path.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MAX_KEYS = 4096

HexKey = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{1,16}$", strip_whitespace=False),
                   Field(description="A unit key: 1-16 hex digits (64 bits).", examples=["00000000000050a0"])]
HexPrefix = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{0,16}$"),
                      Field(description="A key prefix: 0-16 hex digits of the 16-digit key.")]
# The cluster directory's node ids (tutti_cluster.cluster.directory.NODE_ID_PATTERN): 1-253
# characters, none of them '/' or U+FFFD; a test keeps the two the same.
NodeId = Annotated[str, StringConstraints(pattern="^[^/\ufffd]{1,253}$")]


def node_path(node_id: str, tail: str = "") -> str:
    """The path of a node's routes, its id percent-encoded (ids may hold '?', '#', ':' or spaces)."""
    return f"/v1/nodes/{quote(node_id, safe='')}{tail}"


def key_text(key: int) -> str:
    return f"{int(key) & 0xFFFFFFFFFFFFFFFF:016x}"


def key_int(text: str) -> int:
    return int(text, 16)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Health(_Model):
    status: Literal["ok"] = "ok"


class Readiness(_Model):
    ready: bool
    reasons: list[str] = Field(description="Why the node is not ready (empty when ready).")
    checks: dict[str, bool] = Field(description="Each dependency: the node daemon's socket, etcd in cluster mode.")


class InstanceInfo(_Model):
    name: str
    capacity_bytes: list[int] = Field(description="Share of each storage path granted to the instance.")
    memory_capacity_bytes: list[int] = Field(default_factory=list, description="Share of each memory path granted "
                                             "to the instance (empty: no memory tier).")
    units: int = Field(description="Units found in the instance's pool headers (both tiers).")
    memory_units: int = Field(default=0, description="Units with a copy in the memory tier.")
    used_bytes: int = Field(description="Slots holding a unit, times the slot size.")
    total_slots: int
    free_slots: int
    engine_connected: bool = Field(description="The engine process polls the daemon for admin commands.")
    pinned: int | None = Field(default=None, description="Units pinned in the engine's store (None: engine not connected).")


class DrainStatus(_Model):
    state: Literal["serving", "draining", "drained"]
    mode: Literal["replicated", "all", "none"] | None = None
    units_left: int = Field(description="Units still held by this node.")
    replicated_elsewhere: int | None = Field(default=None, description="Units left that another node also holds (cluster mode; None on a single node).")
    pinned_left: int = Field(default=0, description="Pinned units left (never evicted by a drain).")
    started_at: float | None = Field(default=None, description="Unix time the drain began.")


class NodeInfo(_Model):
    node_id: str
    mode: Literal["single", "cluster"]
    reachable: bool = True
    error: str | None = Field(default=None, description="Why the node could not be asked (cluster-wide admin).")
    admin: str | None = Field(default=None, description="The node's admin API address (cluster mode).")
    paths: list[str] = Field(default_factory=list)
    capacity_bytes: list[int] = Field(default_factory=list, description="Byte cap of each storage path.")
    memory_paths: list[str] = Field(default_factory=list, description="The memory tier's paths (empty: none).")
    memory_capacity_bytes: list[int] = Field(default_factory=list, description="Byte cap of each memory path.")
    units: int = 0
    used_bytes: int = 0
    instances: list[InstanceInfo] = Field(default_factory=list)
    drain: DrainStatus | None = None


class NodeList(_Model):
    nodes: list[NodeInfo]


class Counters(_Model):
    units: int = 0
    capacity_bytes: int = 0
    used_bytes: int = 0
    pinned: int = 0
    lookups: int = Field(default=0, description="Units asked for in engine lookups.")
    hits: int = Field(default=0, description="Units found by engine lookups (leading hits).")
    misses: int = 0
    hit_rate: float | None = None
    bytes_read: int = 0
    bytes_written: int = 0
    read_bytes_per_s: float = Field(default=0.0, description="Over the interval between the engines' last two reports.")
    write_bytes_per_s: float = 0.0
    evictions: int = 0
    checksum_failures: int = 0
    io_errors: int = 0
    stage_units: int = Field(default=0, description="Units this node served to other nodes (remote fetches).")
    stage_bytes: int = 0
    stage_failures: int = 0
    directory_errors: int = 0
    remote_units: int = Field(default=0, description="Units the engines fetched from other nodes.")
    remote_bytes: int = 0
    remote_failures: int = 0
    notification_queue: int = Field(default=0, description="Commit/evict notifications waiting in the engines' links.")
    command_queue: int = Field(default=0, description="Admin commands waiting for the engines to take them.")
    # The memory tier (zero without one); units, slots and bytes above count both tiers.
    memory_capacity_bytes: int = Field(default=0, description="Bytes of the memory tier.")
    memory_units: int = Field(default=0, description="Units with a copy in the memory tier.")
    memory_slots: int = Field(default=0, description="Slots of the memory tier.")
    memory_free_slots: int = 0
    memory_hits: int = Field(default=0, description="Store lookup hits whose fastest copy is in the memory tier.")
    storage_hits: int = Field(default=0, description="Store lookup hits whose only copy is in the storage tier.")
    memory_bytes_read: int = Field(default=0, description="Bytes retrieved from the memory tier (bytes_read counts both).")
    promotions: int = Field(default=0, description="Units copied from the storage tier into the memory tier.")
    demotions: int = Field(default=0, description="Memory copies dropped to make room, their storage copy kept.")
    flushes: int = Field(default=0, description="Units copied from the memory tier to the storage tier.")
    flush_bytes: int = 0
    flush_errors: int = Field(default=0, description="Copies to the storage tier that failed.")
    flush_backlog: int = Field(default=0, description="Units in the memory tier only, not durable until copied to "
                                                      "the storage tier.")


class NodeStats(Counters):
    node_id: str
    reachable: bool = True
    error: str | None = None
    instances: dict[str, Counters] = Field(default_factory=dict)


class StatsResponse(_Model):
    totals: Counters
    nodes: list[NodeStats]


class ConfigResponse(_Model):
    nodes: dict[str, dict[str, Any]] = Field(description="Each node's settings, secrets redacted.")


UnitTier = Literal["memory", "storage", "both"]
PinTier = Literal["any", "memory"]


class ObjectInfo(_Model):
    key: str
    nodes: list[str] = Field(description="Nodes holding the unit.")
    instances: dict[str, list[str]] = Field(description="Per node, the store instances holding it.")
    pinned: bool
    tiers: dict[str, dict[str, UnitTier]] = Field(default_factory=dict, description=(
        "Per node, where each instance holds the unit: `memory` (in the memory tier only, not durable until "
        "its storage copy is written), `storage`, or `both`. Asked of each engine; for an engine that is gone, "
        "as the node's last rescan of its pools found it (an instance left out: not known)."))


class ObjectList(_Model):
    objects: list[ObjectInfo]
    truncated: bool = Field(description="More units match than `limit`.")


class EvictResult(_Model):
    evicted: int
    pinned_kept: int = Field(description="Matching units left in place because they are pinned.")
    unreachable: int = Field(description="Matching units whose engine did not answer (their engine is gone).")
    nodes: dict[str, dict[str, int]] = Field(default_factory=dict, description="The same counts per node.")
    unreachable_nodes: list[str] = Field(default_factory=list, description="Nodes that did not answer (cluster-wide admin).")


class KeysRequest(_Model):
    keys: list[HexKey] = Field(min_length=1, max_length=MAX_KEYS)


class PinRequest(KeysRequest):
    tier: PinTier = Field(default="any", description=(
        "`any`: protect the units from eviction wherever they lie. `memory`: also copy each unit that lies on "
        "storage only into the memory tier (in the background) and keep it there. A pinned unit's memory copy is "
        "never demoted, whatever its tier. Pinning a pinned key again records the new tier."))


class PinResult(_Model):
    pinned: list[str]
    absent: list[str] = Field(description="Keys no store on the node(s) holds.")
    unreachable: list[str] = Field(description="Keys held only by engines that did not answer.")
    no_memory_tier: list[str] = Field(default_factory=list, description=(
        "With tier `memory`: keys pinned by an engine that has no memory tier. The pin protects them where "
        "they lie; they are not in memory there."))


class UnpinResult(_Model):
    unpinned: list[str]
    not_pinned: list[str]
    unreachable: list[str]


class PinList(_Model):
    pins: list[str]
    count: int
    tiers: dict[str, PinTier] = Field(default_factory=dict, description="Each pin's tier (see `POST /v1/pins`).")


class DrainRequest(_Model):
    mode: Literal["replicated", "all", "none"] = Field(default="replicated",
        description="replicated: evict each unit once another node holds it; all: evict every unpinned unit "
        "now; none: only stop taking new units.",
    )


class DrainResponse(_Model):
    node_id: str
    drain: DrainStatus

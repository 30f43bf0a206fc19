"""vLLM v1 KV connector backed by a Tutti store: ``TuttiConnector``.

Load it by module path (vLLM 0.32 / 0.33 ``KVConnectorBase_V1`` API)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TuttiConnector",
        "kv_connector_module_path": "tutti_cluster.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"paths": ["/mnt/nvme0"], "unit_tokens": 256}}'

The connector is split as vLLM splits it:

- **Scheduler role** (engine-core process): answers ``get_num_new_matched_tokens`` from the set of
  unit keys present in the workers' stores. That set starts from the keys each worker found on disk
  when it opened its share of the file pool (sent once through the connector handshake) and then
  follows every commit and eviction the workers report after each step, so a fresh engine sees the
  units an earlier engine committed and no lookup touches storage.
- **Worker role** (one per GPU/CPU worker rank): opens one :class:`~tutti_cluster.TuttiStore`
  instance per rank (``<instance>-r<rank>``), registers vLLM's paged KV tensors, and maps the
  layer-wise hooks onto the store: ``start_load_kv``/``wait_for_layer_load`` onto ``retrieve_layer``
  and ``wait_layer``, ``save_kv_layer``/``wait_for_save`` onto ``store_layer``, ``wait_layer`` and
  ``finish``.

Keys: a cache unit is ``unit_tokens // block_size`` consecutive vLLM blocks. vLLM's block hashes
chain over the whole prefix, so the hash of a unit's last block names the unit; the store key is
that hash combined with a namespace (model, dtype, block size, parallel layout) and the worker rank.

A unit that fails to load (missing, evicted since the lookup, checksum mismatch) is reported through
``get_block_ids_with_load_errors``; with ``kv_load_failure_policy: "recompute"`` vLLM recomputes it,
and the connector saves it again. KV computed on top of a load is saved only once that load is known
good, so a failed load never reaches storage. Saves are finished inside ``wait_for_save``; a request
that finishes while a save of its blocks is pending keeps them until that save is done.

With ``etcd`` configured (cluster mode) the scheduler also looks units up in the replica directory
and the workers fetch other nodes' units over the Transfer Engine; the node daemon, when one runs,
hears every commit and eviction. docs/VLLM.md has the configuration and the command lines.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any

from tutti_cluster.config import TuttiConfig, load_config
from tutti_cluster.errors import ConfigError, LayoutError, TuttiError
from tutti_cluster.keys import to_key
from tutti_cluster.kv_layout import LayerKV, layer_kv_from_tensor

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError as e:  # vLLM is the optional extra ``tutti-cluster[vllm]``
    raise ImportError("tutti_cluster.vllm needs vLLM: pip install 'tutti-cluster[vllm]'") from e

try:  # present from vLLM 0.32 on; older releases label every external hit the same way
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _DISK_SOURCE: Any = CacheHitSource.DISK
except ImportError:  # pragma: no cover - depends on the vLLM release
    _DISK_SOURCE = None

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = [
    "ConnectorOptions",
    "TuttiConnector",
    "TuttiConnectorStats",
    "connector_config",
    "layer_kv_from_vllm",
    "unit_hashes",
]

# Keys of kv_connector_extra_config that belong to the connector rather than to TuttiConfig.
_CONNECTOR_KEYS = ("load_async", "namespace")
_STAT_KEYS = (
    "lookup_hit_units",
    "load_units",
    "load_failed_units",
    "store_units",
    "store_skipped_units",
    "store_failed_units",
    "store_deferred_units",
    "remote_units",
)


# ---- configuration ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConnectorOptions:
    """Connector settings that are not store settings.

    ``load``/``save`` follow ``kv_role``: a ``kv_producer`` only saves, a ``kv_consumer`` only loads,
    ``kv_both`` does both. ``load_async`` makes loads run between scheduler steps (vLLM's
    WAITING_FOR_REMOTE_KVS) instead of inside the step that needs them. ``namespace`` overrides the
    model identity mixed into every key (default: model path, dtype, block size, parallel layout).
    """

    load: bool = True
    save: bool = True
    load_async: bool = False
    namespace: str | None = None


def _as_bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"kv_connector_extra_config.{name} must be a boolean, got {v!r}")


def connector_config(extra: dict[str, Any] | None, kv_role: str | None = None) -> tuple[TuttiConfig, ConnectorOptions]:
    """Splits ``kv_connector_extra_config`` into a :class:`TuttiConfig` and :class:`ConnectorOptions`.

    Every :class:`TuttiConfig` field may appear in ``extra``; fields it leaves out come from the
    ``TUTTI_*`` environment, then ``TUTTI_CONFIG_FILE``, then defaults (so ``TUTTI_PATHS`` sets the
    storage paths). Unknown keys raise :class:`ConfigError`.
    """
    extra = dict(extra or {})
    conn = {k: extra.pop(k) for k in _CONNECTOR_KEYS if k in extra}
    unknown = sorted(k for k in extra if k not in TuttiConfig.model_fields)
    if unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config keys {unknown}; allowed: "
            f"{sorted([*TuttiConfig.model_fields, *_CONNECTOR_KEYS])}"
        )
    cfg = load_config(**extra)
    role = kv_role or "kv_both"
    if role not in ("kv_both", "kv_producer", "kv_consumer"):
        raise ConfigError(f"kv_role must be kv_both, kv_producer or kv_consumer, got {role!r}")
    ns = conn.get("namespace")
    if ns is not None and not isinstance(ns, str):
        raise ConfigError("kv_connector_extra_config.namespace must be a string")
    opts = ConnectorOptions(
        load=role != "kv_producer",
        save=role != "kv_consumer",
        load_async=_as_bool("load_async", conn.get("load_async", False)),
        namespace=ns,
    )
    return cfg, opts


# ---- keys ---------------------------------------------------------------------------------------
def unit_hashes(block_hashes: list[Any], unit_hash_blocks: int, num_units: int) -> list[bytes]:
    """The hash naming each of the first ``num_units`` units: that of the unit's last hash block.

    ``unit_hash_blocks`` is how many of vLLM's hash blocks make one unit. vLLM chains its block hashes
    (each covers the parent's), so the last one names the unit's whole prefix.
    """
    n = min(num_units, len(block_hashes) // unit_hash_blocks)
    return [bytes(block_hashes[(u + 1) * unit_hash_blocks - 1]) for u in range(n)]


def _namespace(vllm_config: VllmConfig, opts: ConnectorOptions, unit_tokens: int) -> bytes:
    if opts.namespace is not None:
        ident = opts.namespace
    else:
        mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        ident = "|".join(
            str(x)
            for x in (
                mc.model,
                getattr(mc, "revision", None),
                mc.dtype,
                cc.cache_dtype,
                cc.block_size,
                pc.tensor_parallel_size,
                pc.pipeline_parallel_size,
            )
        )
    return hashlib.blake2b(f"tutti-vllm|{ident}|{unit_tokens}".encode(), digest_size=16).digest()


def _rank_prefix(namespace: bytes, rank: int) -> bytes:
    return namespace + rank.to_bytes(4, "little")


def _key(prefix: bytes, unit_hash: bytes) -> int:
    return to_key(prefix + unit_hash)


# ---- KV layout ----------------------------------------------------------------------------------
def layer_kv_from_vllm(t: Any, num_blocks: int) -> LayerKV:
    """Describes one layer's paged KV cache as vLLM hands it to ``register_kv_caches``.

    Accepted forms, told apart by where ``num_blocks`` sits:

    - vLLM's standardised per-layer view ``[B, H, N, C]`` (blocks outermost; K and V inside each
      block, MLA with ``H == 1``): one object per block. A view with ``k * num_blocks`` kernel blocks
      (virtual block splitting) maps ``k`` consecutive kernel blocks onto one block when they are
      dense. Views with the heads outside the blocks (``LHBNC``, ``BHLNC``) give one object per head
      run; the store takes two per block, so more than two KV heads per rank there is refused.
    - legacy ``[2, num_blocks, ...]`` (K and V planes) and a ``(K, V)`` pair of tensors.
    """
    if isinstance(t, (tuple, list)):
        return layer_kv_from_tensor(tuple(t), "kv_tuple")
    shape = tuple(t.shape)
    if len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks and num_blocks != 2:
        return layer_kv_from_tensor(t, "kv_first")
    if not shape or shape[0] % num_blocks:
        raise LayoutError(f"KV cache of shape {shape} has no dimension of {num_blocks} blocks")
    ratio = shape[0] // num_blocks
    if ratio == 1:
        try:
            return layer_kv_from_tensor(t, "interleaved")
        except LayoutError:
            pass
        return _head_split(t, shape)
    # ratio kernel blocks per block: only dense tensors keep a block contiguous.
    es = t.element_size()
    inner = prod(shape[1:])
    if not t.is_contiguous():
        raise LayoutError(f"KV cache {shape} splits blocks into {ratio} kernel blocks and is not dense")
    return LayerKV(
        (t.data_ptr(),), inner * ratio * es, inner * ratio * es, num_blocks,
        "cuda" if str(t.device).startswith("cuda") else str(t.device),
        str(t.dtype).replace("torch.", ""), (ratio, *shape[1:]),
    )


def _head_split(t: Any, shape: tuple[int, ...]) -> LayerKV:
    """``[B, H, N, C]`` views whose heads lie outside the blocks (LHBNC, BHLNC): one object per head.

    Each ``[N, C]`` run must be contiguous; the store takes at most two objects per block.
    """
    strides, es = tuple(t.stride()), t.element_size()
    if len(shape) != 4 or strides[3] != 1 or (shape[2] > 1 and strides[2] != shape[3]):
        raise LayoutError(f"KV cache {shape} strides {strides}: a block's tokens must be contiguous")
    if shape[1] > 2:
        raise LayoutError(
            f"KV cache {shape} strides {strides} splits each block into {shape[1]} head runs; the store "
            "takes at most 2 objects per block: use a block-compact layout (VLLM_KV_CACHE_LAYOUT=LBHNC or LBNHC)"
        )
    ptrs = tuple(t.data_ptr() + h * strides[1] * es for h in range(shape[1]))
    return LayerKV(
        ptrs, strides[0] * es, shape[2] * shape[3] * es, shape[0],
        "cuda" if str(t.device).startswith("cuda") else str(t.device),
        str(t.dtype).replace("torch.", ""), (shape[2], shape[3]),
    )


# ---- metadata passed between the roles ----------------------------------------------------------
@dataclass
class _Transfer:
    """One request's units to move this step: ``hashes[i]`` names unit ``i``; its blocks are
    ``block_ids[i * unit_blocks : (i + 1) * unit_blocks]``."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    first_unit: int = 0  # index of unit 0 of this transfer in the request's prompt
    remote_from: int | None = None  # loads: units from this index on come from other nodes
    finish: bool = False  # saves: the request has finished; report it once the save is done


@dataclass
class TuttiConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[_Transfer] = field(default_factory=list)
    async_loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class TuttiWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: keys that became present or absent in the stores, and
    per request the first unit that failed to load (vLLM recomputes it; the scheduler saves it again)."""

    committed: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TuttiWorkerMetadata)
        failed = dict(self.failed)
        for req_id, unit in other.failed.items():
            failed[req_id] = min(unit, failed.get(req_id, unit))
        return TuttiWorkerMetadata(self.committed + other.committed, self.evicted + other.evicted, failed)


@dataclass
class TuttiHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at start: the keys its store found on disk."""

    rank: int
    keys: list[int]


# ---- stats --------------------------------------------------------------------------------------
@dataclass
class TuttiConnectorStats(KVConnectorStats):
    """Unit counters of one interval, summed over workers and the scheduler."""

    def __post_init__(self) -> None:
        for k in _STAT_KEYS:
            self.data.setdefault(k, 0)

    def add(self, name: str, n: int) -> None:
        self.data[name] = self.data.get(name, 0) + int(n)

    def reset(self) -> None:
        self.data = {k: 0 for k in _STAT_KEYS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + int(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: int(v) for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> TuttiConnectorStats | None:
        """Returns the counts so far (None if all zero) and starts a new interval."""
        if self.is_empty():
            return None
        out = TuttiConnectorStats(data=dict(self.data))
        self.reset()
        return out


class TuttiPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per stat: ``vllm:tutti_<stat>_total`` (units)."""

    _DOC = {
        "lookup_hit_units": "Cache units the scheduler found in the Tutti store and scheduled to load.",
        "load_units": "Cache units the Tutti store loaded into KV blocks.",
        "load_failed_units": "Cache units whose load failed (missing or corrupt) and were recomputed.",
        "store_units": "Cache units committed to the Tutti store.",
        "store_skipped_units": "Cache units not stored because the store already held them.",
        "store_failed_units": "Cache units whose store failed (capacity or I/O).",
        "store_deferred_units": "Cache units whose save waited until a step that loaded KV was known good.",
        "remote_units": "Cache units fetched from other nodes' stores (cluster mode).",
    }

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        for name in _STAT_KEYS:
            counter = self._counter_cls(name=f"vllm:tutti_{name}", documentation=self._DOC[name],
                                        labelnames=labelnames)
            for idx, values in per_engine_labelvalues.items():
                self._counters[(idx, name)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, v in transfer_stats_data.items():
            c = self._counters.get((engine_idx, name))
            if c is not None and v:
                c.inc(v)


# ---- the connector ------------------------------------------------------------------------------
@dataclass
class _ReqState:
    request: Any
    save_next: int = 0  # first unit not yet claimed for a save (or known present)
    block_ids: list[int] = field(default_factory=list)
    pending: set[int] = field(default_factory=set)  # claimed units whose save waits (see build_connector_meta)
    due: int = 0  # the step from which the pending units may be saved
    finished: bool = False  # finished, blocks held until the pending save is done


@dataclass
class _InFlight:
    transfer: _Transfer
    handle: int
    keys: list[int]
    error: bool = False  # a layer call or wait failed: nothing of it counts as loaded (or saved)


class TuttiConnector(KVConnectorBase_V1):
    """KV connector that serves and persists prefix KV through a Tutti store (see module docs)."""

    # Loads come from SSD-backed storage.
    if _DISK_SOURCE is not None:
        _cache_hit_source = _DISK_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        tcfg = self._kv_transfer_config
        self.config, self.options = connector_config(tcfg.kv_connector_extra_config, tcfg.kv_role)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.unit_tokens = int(self.config.unit_tokens)
        if self.unit_tokens % self.block_size:
            raise ConfigError(
                f"unit_tokens ({self.unit_tokens}) must be a multiple of the vLLM block size ({self.block_size})"
            )
        self.unit_blocks = self.unit_tokens // self.block_size
        hash_block = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
        if self.unit_tokens % hash_block:
            raise ConfigError(
                f"unit_tokens ({self.unit_tokens}) must be a multiple of the hash block size ({hash_block})"
            )
        self.unit_hash_blocks = self.unit_tokens // hash_block
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ConfigError("TuttiConnector supports one KV cache group (disable the hybrid KV cache manager)")
        pc = vllm_config.parallel_config
        self.world = int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)
        self.namespace = _namespace(vllm_config, self.options, self.unit_tokens)
        self._prefixes = [_rank_prefix(self.namespace, r) for r in range(self.world)]
        self._stats = TuttiConnectorStats()
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ================================ scheduler role ================================
    def _init_scheduler(self) -> None:
        if self.options.load and getattr(self._kv_transfer_config, "kv_load_failure_policy", None) == "fail":
            log.warning(
                "Tutti connector: kv_load_failure_policy is 'fail' (vLLM's default), so a unit that fails to "
                "load (evicted since the lookup, a missing file, a checksum mismatch) fails the request that "
                "needed it instead of being recomputed; set \"kv_load_failure_policy\": \"recompute\" in "
                "--kv-transfer-config (docs/VLLM.md)")
        self._present: set[int] = set()
        self._reqs: dict[str, _ReqState] = {}
        self._lookups: dict[str, tuple[int, int]] = {}  # req_id -> (local, all) hit units of the latest lookup
        self._pending_loads: list[_Transfer] = []
        self._pending_async: list[_Transfer] = []
        self._lookups_at: dict[str, tuple[float, int, int, int]] = {}  # req_id -> (time, units asked, local, all)
        self._step = 0
        self._last_load_step = -(1 << 30)
        # Steps whose outcome may still be unknown when the next one is scheduled (async scheduling,
        # pipeline parallelism): a load failure there is reported that many steps later.
        self._defer = max(1, int(getattr(self._vllm_config, "max_concurrent_batches", 1) or 1))
        self._directory: Any = None
        if self.options.load and self.config.etcd:
            # Cluster mode: units past the local hit prefix are looked up in the replica directory.
            from tutti_cluster.cluster.directory import EtcdDirectory

            node_id = self.config.node_id or socket.gethostname()
            self._directory = EtcdDirectory(",".join(self.config.etcd), node_id, self.config.lease_ttl_s)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        for m in metadata.values():
            if isinstance(m, TuttiHandshake):
                self._present.update(m.keys)
        log.info("Tutti connector: %d units present in the workers' stores", len(self._present))

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        # Every pipeline stage has its own store; all of them report their keys.
        self.set_xfer_handshake_metadata({i: m for i, m in enumerate(metadata.values())})

    def _hits(self, hashes: list[bytes]) -> int:
        """Leading units present on every rank."""
        n = len(hashes)
        for prefix in self._prefixes:
            i = 0
            while i < n and _key(prefix, hashes[i]) in self._present:
                i += 1
            n = i
            if n == 0:
                break
        return n

    def _remote_hits(self, hashes: list[bytes], local: int) -> int:
        """Units after the first ``local`` that other nodes hold for every rank (cluster mode)."""
        n = len(hashes) - local
        for prefix in self._prefixes:
            if n == 0:
                break
            owners = self._directory.lookup([_key(prefix, h) for h in hashes[local : local + n]],
                                            prefix=True, exclude_self=False)
            n = min(n, len(owners))
        return n

    def _lookup(self, request: Request) -> tuple[int, int]:
        """(local, total) leading units of the request's prompt available to load.

        A directory lookup costs an etcd round trip, and vLLM asks again for a request it could not
        schedule yet, so a cluster answer is reused for a second.
        """
        max_units = max(request.num_tokens - 1, 0) // self.unit_tokens
        if max_units == 0:
            return 0, 0
        hashes = self._hashes(request, max_units)
        local = self._hits(hashes)
        if self._directory is None or local == len(hashes):
            return local, local
        now = time.monotonic()
        cached = self._lookups_at.get(request.request_id)
        if cached is not None and now - cached[0] < 1.0 and cached[1:3] == (len(hashes), local):
            return local, cached[3]
        total = local + self._remote_hits(hashes, local)
        self._lookups_at[request.request_id] = (now, len(hashes), local, total)
        return local, total

    def _hashes(self, request: Request, num_units: int) -> list[bytes]:
        return unit_hashes(list(request.block_hashes), self.unit_hash_blocks, num_units)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose whole units the stores hold.

        At least the last prompt token is left to compute. Side-effect free for vLLM; the lookup is
        remembered for ``update_state_after_alloc``.
        """
        if not self.options.load:
            return 0, False
        local, hits = self._lookup(request)
        self._lookups[request.request_id] = (local, hits)
        ext = hits * self.unit_tokens - num_computed_tokens
        if ext <= 0:
            return 0, False
        return ext, self.options.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        looked = self._lookups.pop(req_id, None)
        local, hits = looked if looked is not None else self._lookup(request)
        state = self._reqs.get(req_id)
        if state is None or num_external_tokens > 0:
            state = _ReqState(request=request, save_next=hits)
            self._reqs[req_id] = state
        else:
            state.request = request
        if num_external_tokens <= 0:
            return
        end = hits * self.unit_tokens
        first = (end - num_external_tokens) // self.unit_tokens
        (block_ids,) = blocks.get_block_ids()[:1]
        hashes = self._hashes(request, hits)[first:hits]
        ids = list(block_ids[first * self.unit_blocks : hits * self.unit_blocks])
        if len(ids) != len(hashes) * self.unit_blocks:
            log.warning("request %s: %d blocks allocated for %d units; not loading", req_id, len(ids), len(hashes))
            return
        self._stats.add("lookup_hit_units", len(hashes))
        remote_from = max(local - first, 0) if hits > local else None
        t = _Transfer(req_id, hashes, ids, first, remote_from)
        (self._pending_async if self.options.load_async else self._pending_loads).append(t)

    def _track_blocks(self, scheduler_output: SchedulerOutput) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            new_ids = cached.new_block_ids[i]
            if st is None or new_ids is None:
                continue
            if req_id in resumed:
                st.block_ids = list(new_ids[0])
            else:
                st.block_ids.extend(new_ids[0])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Loads decided since the last step, and saves of units whose last token is computed.

        A unit is saved in the step that computes its last token, unless that step (or one of the
        steps before it whose outcome is not yet known) loads KV: a failed load leaves bad KV in its
        blocks, and whatever the same step computes on top of them is bad too. Such units wait until
        the step's outcome is known (the next step, or ``max_concurrent_batches`` steps later); units
        on blocks vLLM reports invalid are then dropped, recomputed by vLLM and saved again.
        """
        self._step += 1
        step = self._step
        self._track_blocks(scheduler_output)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self._reqs.get(req_id)
            if st is not None and st.pending:  # blocks freed: nothing left to save from
                st.save_next = min(st.save_next, min(st.pending))
                st.pending.clear()
        meta = TuttiConnectorMetadata(loads=self._pending_loads, async_loads=self._pending_async)
        self._pending_loads, self._pending_async = [], []
        if meta.loads:
            self._last_load_step = step
        if not self.options.save:
            return meta
        risky = step - self._last_load_step < self._defer
        seen: set[bytes] = set()
        # Saves that waited for their step's outcome.
        for req_id, st in list(self._reqs.items()):
            if (st.pending or st.finished) and st.due <= step:
                units = sorted(st.pending)
                st.pending.clear()
                self._emit(meta, req_id, st, units, seen)
        computed: dict[str, int] = {n.req_id: n.num_computed_tokens for n in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or req_id not in computed:
                continue
            done = min(computed[req_id] + n_sched, st.request.num_prompt_tokens)
            end_unit = min(done // self.unit_tokens, len(st.block_ids) // self.unit_blocks,
                           len(st.request.block_hashes) // self.unit_hash_blocks)
            if end_unit <= st.save_next:
                continue
            units = list(range(st.save_next, end_unit))
            st.save_next = end_unit
            if risky:
                st.pending.update(units)
                st.due = step + self._defer
                self._stats.add("store_deferred_units", len(units))
            else:
                self._emit(meta, req_id, st, units, seen)
        return meta

    def _emit(self, meta: TuttiConnectorMetadata, req_id: str, st: _ReqState, units: list[int],
              seen: set[bytes]) -> None:
        """Adds a save of ``units`` of a request (those not yet present) to this step's metadata."""
        hashes = self._hashes(st.request, max(units) + 1) if units else []
        units = [u for u in units if u < len(hashes) and hashes[u] not in seen
                 and not all(_key(p, hashes[u]) in self._present for p in self._prefixes)]
        seen.update(hashes[u] for u in units)
        ids: list[int] = []
        for u in units:
            ids.extend(st.block_ids[u * self.unit_blocks : (u + 1) * self.unit_blocks])
        if units or st.finished:
            meta.saves.append(_Transfer(req_id, [hashes[u] for u in units], ids, finish=st.finished))
        if st.finished:
            del self._reqs[req_id]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, TuttiWorkerMetadata):
            self._present.update(meta.committed)
            self._present.difference_update(meta.evicted)
            for req_id, unit in meta.failed.items():
                self._unclaim(req_id, unit)
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            # vLLM recomputes every request from its first invalid block (shared blocks included):
            # nothing computed on top of them may be saved; save the units again once recomputed.
            for req_id, st in self._reqs.items():
                for i, b in enumerate(st.block_ids):
                    if b in invalid:
                        self._unclaim(req_id, i // self.unit_blocks)
                        break

    def _unclaim(self, req_id: str, unit: int) -> None:
        st = self._reqs.get(req_id)
        if st is None:
            return
        st.save_next = min(st.save_next, unit)
        st.pending = {u for u in st.pending if u < unit}

    def has_pending_push_work(self) -> bool:
        # A finished request's deferred save holds its blocks: keep the engine stepping until done.
        return any(st.finished for st in self._reqs.values()) if self._role == KVConnectorRole.SCHEDULER else False

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Frees the blocks at once unless a deferred save still has to read them; then the worker
        reports the request (``get_finished``) once that save is done."""
        self._lookups.pop(request.request_id, None)
        self._lookups_at.pop(request.request_id, None)
        st = self._reqs.get(request.request_id)
        if st is not None and st.pending:
            st.finished = True
            return True, None
        self._reqs.pop(request.request_id, None)
        return False, None

    # ================================ worker role ================================
    def _init_worker(self) -> None:
        self.store: Any = None
        self.rank = 0
        self._layer_index: dict[str, int] = {}
        self._owner_layer: dict[str, bool] = {}
        self._loads: list[_InFlight] = []
        self._async: list[_InFlight] = []
        self._saves: list[_InFlight] = []
        self._saves_started = False
        self._saved_layers: set[int] = set()
        self._invalid: set[int] = set()
        self._finished_recving: set[str] = set()
        self._finished_sending: set[str] = set()
        self._finishing: list[str] = []
        self._committed: list[int] = []
        self._evicted: list[int] = []
        self._failed: dict[str, int] = {}
        self._link: Any = None  # the node daemon's socket, when a daemon runs
        self._cluster: Any = None  # remote fetches, in cluster mode

    def _worker_rank(self) -> int:
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            tp = get_tp_group()
            return get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group
        except (ImportError, AssertionError, AttributeError):  # parallel state not initialised: one rank
            return 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Opens this rank's store instance and registers every attention layer's KV blocks."""
        from tutti_cluster.store import TuttiStore

        num_blocks = int(self._kv_cache_config.num_blocks)
        layers: list[LayerKV] = []
        by_ptr: dict[int, int] = {}
        for name, t in kv_caches.items():
            first = t[0] if isinstance(t, (tuple, list)) else t
            ptr = first.data_ptr()
            if ptr in by_ptr:  # a layer that shares an earlier layer's KV (cross-layer KV sharing)
                self._layer_index[name] = by_ptr[ptr]
                self._owner_layer[name] = False
                continue
            by_ptr[ptr] = len(layers)
            self._layer_index[name] = len(layers)
            self._owner_layer[name] = True
            layers.append(layer_kv_from_vllm(t, num_blocks))
        self.rank = self._worker_rank()
        pc = self._vllm_config.parallel_config
        instance = f"{self.config.instance}-r{self.rank}"
        if int(getattr(pc, "data_parallel_size", 1)) > 1:
            instance += f"-dp{int(getattr(pc, 'data_parallel_rank', 0))}"
        cfg = self.config.model_copy(update={"instance": instance})
        self.store = TuttiStore(cfg)
        self.store.register_kv_caches(layers, block_tokens=self.block_size)
        self._attach_node(cfg)
        self._prefix = (self._prefixes[self.rank] if self.rank < len(self._prefixes)
                        else _rank_prefix(self.namespace, self.rank))
        log.info("Tutti connector rank %d: instance %s, %d layers, %d blocks/unit, %d units on disk",
                 self.rank, instance, len(layers), self.unit_blocks, len(self.store.keys()))

    def _attach_node(self, cfg: TuttiConfig) -> None:
        """Announces the store to the node daemon (when one runs) and, in cluster mode, opens the
        remote-fetch client. The daemon registers committed units in the cluster directory."""
        from tutti_cluster.daemon import DaemonLink

        link = DaemonLink(cfg)
        if link.attach(self.store) is not None:
            self._link = link
            to_daemon_commit, to_daemon_evict = self.store.on_commit, self.store.on_evict
        else:
            link.close()
            to_daemon_commit = to_daemon_evict = None

        def on_commit(key: int) -> None:
            self._committed.append(key)
            if to_daemon_commit is not None:
                to_daemon_commit(key)

        def on_evict(key: int) -> None:
            self._evicted.append(key)
            if to_daemon_evict is not None:
                to_daemon_evict(key)

        self.store.on_commit, self.store.on_evict = on_commit, on_evict
        if cfg.etcd and self.options.load:
            from tutti_cluster.cluster.client import ClusterClient

            self._cluster = ClusterClient(self.store, cfg, link=self._link)  # its counters reach the daemon

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.store is None:
            return None
        return TuttiHandshake(rank=self.rank, keys=self.store.keys())

    def _begin(self, t: _Transfer, load: bool) -> _InFlight | None:
        keys = [_key(self._prefix, h) for h in t.hashes]
        try:
            if load:
                h = self.store.begin_retrieve(keys, t.block_ids)
            else:
                h = self.store.begin_store(keys, t.block_ids)
        except TuttiError as e:
            log.warning("Tutti %s of request %s not started: %s", "load" if load else "store", t.req_id, e)
            if load:
                self._invalid.update(t.block_ids)
                self._failed[t.req_id] = min(t.first_unit, self._failed.get(t.req_id, t.first_unit))
                self._stats.add("load_failed_units", len(keys))
            else:
                self._stats.add("store_failed_units", len(keys))
            return None
        return _InFlight(t, h, keys)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Hands each request's units to the store and starts every layer's retrieve."""
        if self.store is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TuttiConnectorMetadata)
        for transfers, sink in ((meta.loads, self._loads), (meta.async_loads, self._async)):
            for t in transfers:
                if t.remote_from is not None:
                    t = self._fetch_remote(t)
                    if not t.hashes:  # all remote: done (placed, or reported as failed blocks)
                        if sink is self._async:
                            self._finished_recving.add(t.req_id)
                        continue
                f = self._begin(t, load=True)
                if f is None:
                    if sink is self._async:
                        self._finished_recving.add(t.req_id)
                    continue
                try:
                    for layer in range(self.store.num_layers):
                        self.store.retrieve_layer(layer, f.handle)
                except TuttiError as e:
                    log.warning("Tutti load of request %s failed to start: %s", t.req_id, e)
                    f.error = True
                sink.append(f)  # finished in any case: the store holds its pins and IOCBs until then

    def _fetch_remote(self, t: _Transfer) -> _Transfer:
        """Places the transfer's remote units (other nodes' SSDs, over the Transfer Engine) into their
        blocks, keeping a local replica; returns the local part, to load through the store."""
        assert t.remote_from is not None
        ub, r = self.unit_blocks, t.remote_from
        keys = [_key(self._prefix, h) for h in t.hashes[r:]]
        placed = 0
        if self._cluster is not None:
            try:
                placed = self._cluster.retrieve_remote(keys, t.block_ids[r * ub :], keep_replica=True)
            except TuttiError as e:
                log.warning("Tutti remote fetch for request %s failed: %s", t.req_id, e)
        self._stats.add("remote_units", placed)
        if placed < len(keys):
            self._invalid.update(t.block_ids[(r + placed) * ub :])
            unit = t.first_unit + r + placed
            self._failed[t.req_id] = min(unit, self._failed.get(t.req_id, unit))
            self._stats.add("load_failed_units", len(keys) - placed)
        return _Transfer(t.req_id, t.hashes[:r], t.block_ids[: r * ub], t.first_unit)

    def wait_for_layer_load(self, layer_name: str) -> None:
        idx = self._layer_index.get(layer_name)
        if idx is None or not self._loads:
            return
        for f in self._loads:
            try:
                self.store.wait_layer(idx, f.handle)
            except TuttiError as e:
                log.warning("Tutti load of request %s, layer %d: %s", f.transfer.req_id, idx, e)
                f.error = True

    def _finish_loads(self, flights: list[_InFlight]) -> None:
        for f in flights:
            try:
                res = self.store.finish(f.handle)
                failed = sorted(res.failed_units)
            except TuttiError as e:
                log.warning("Tutti load of request %s failed: %s", f.transfer.req_id, e)
                failed = [0]
            if f.error:  # a layer of it did not move (or was not waited for): no block is loaded
                failed = [0]
            if failed:
                # vLLM keeps the prefix before the first invalid block and recomputes the rest.
                first = failed[0]
                self._invalid.update(f.transfer.block_ids[first * self.unit_blocks :])
                req_id, unit = f.transfer.req_id, f.transfer.first_unit + first
                self._failed[req_id] = min(unit, self._failed.get(req_id, unit))
                self._stats.add("load_failed_units", len(f.keys) - first)
                self._stats.add("load_units", first)
                log.info("Tutti: %d of %d units of request %s failed to load; vLLM recomputes them",
                         len(f.keys) - first, len(f.keys), f.transfer.req_id)
            else:
                self._stats.add("load_units", len(f.keys))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Starts writing this layer of the units completed in this step (their KV is now in place)."""
        if self.store is None or not self._owner_layer.get(layer_name, False):
            return
        if not self._saves_started:
            self._start_saves()
        idx = self._layer_index[layer_name]
        if idx in self._saved_layers or not self._saves:
            return
        self._saved_layers.add(idx)
        for f in self._saves:
            if f.error:
                continue
            try:
                self.store.store_layer(idx, f.handle)
            except TuttiError as e:  # never into the engine: the save is dropped, finished in wait_for_save
                log.warning("Tutti store of request %s, layer %d: %s", f.transfer.req_id, idx, e)
                f.error = True

    def _start_saves(self) -> None:
        self._saves_started = True
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TuttiConnectorMetadata)
        for t in meta.saves:
            if t.finish:
                self._finishing.append(t.req_id)
            if not t.hashes:
                continue
            f = self._begin(t, load=False)
            if f is not None:
                self._saves.append(f)

    def wait_for_save(self) -> None:
        """Ends the step: finishes the loads and writes it started, so no block is freed under an I/O."""
        if self.store is None:
            return
        if self._loads:
            self._finish_loads(self._loads)
            self._loads = []
        if not self._saves_started:
            self._start_saves()
        for f in self._saves:
            try:
                # Layers that had no save_kv_layer call this step (no forward) are complete now.
                for layer in range(self.store.num_layers):
                    if layer not in self._saved_layers and not f.error:
                        self.store.store_layer(layer, f.handle)
            except TuttiError as e:
                log.warning("Tutti store of request %s failed: %s", f.transfer.req_id, e)
                f.error = True
            try:
                # Always finished, so that its slots and IOCBs go back; a request with a layer that
                # did not move commits nothing.
                res = self.store.finish(f.handle)
            except TuttiError as e:
                log.warning("Tutti store of request %s failed: %s", f.transfer.req_id, e)
                self._stats.add("store_failed_units", len(f.keys))
                continue
            self._stats.add("store_units", len(res.committed_units))
            self._stats.add("store_skipped_units", res.skipped_units)
            self._stats.add("store_failed_units", len(res.failed_units))
        self._saves = []
        self._saves_started = False
        self._saved_layers = set()
        self._finished_sending.update(self._finishing)
        self._finishing = []

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Completes the asynchronous loads started this step; their requests are done receiving."""
        if self._async:
            self._finish_loads(self._async)
            self._finished_recving.update(f.transfer.req_id for f in self._async)
            self._async = []
        done, self._finished_recving = self._finished_recving, set()
        sent, self._finished_sending = self._finished_sending, set()
        return (sent or None), (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._committed and not self._evicted and not self._failed:
            return None
        meta = TuttiWorkerMetadata(self._committed[:], self._evicted[:], self._failed)
        self._committed.clear()
        self._evicted.clear()
        self._failed = {}
        return meta

    def shutdown(self) -> None:
        if getattr(self, "_cluster", None) is not None:
            self._cluster.close()
            self._cluster = None
        if getattr(self, "_link", None) is not None:
            self._link.flush()
            self._link.close()
            self._link = None
        if getattr(self, "store", None) is not None:
            self.store.close()
            self.store = None

    # ================================ both roles ================================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TuttiConnectorStats(data=dict(data)) if data is not None else TuttiConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return TuttiPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load / save_kv_layer run Python between layers.
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped save is a future miss, not a lost hand-off.
        return False

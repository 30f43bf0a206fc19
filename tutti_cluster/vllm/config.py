"""The connector's settings and the keys, the same in both roles.

:func:`connector_config` splits ``kv_connector_extra_config`` into a :class:`TuttiConfig` and the
connector's own :class:`ConnectorOptions`. :class:`ConnectorSetup` is what both roles derive from
vLLM's configuration at start: the unit geometry (``unit_tokens`` over vLLM's block and hash-block
sizes), the parallel world, the namespace and each rank's key prefix.

Keys: a cache unit is ``unit_tokens // block_size`` consecutive vLLM blocks. vLLM's block hashes
chain over the whole prefix, so the hash of a unit's last block names the unit (:func:`unit_hashes`);
the store key is that hash combined with a namespace (model, dtype, block size, parallel layout) and
the worker rank (:func:`rank_prefix`, :func:`unit_key`). The scheduler computes the keys of every
rank to answer lookups; each worker computes its own to move units.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tutti_cluster.config import TuttiConfig, load_config
from tutti_cluster.errors import ConfigError
from tutti_cluster.keys import to_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "CONNECTOR_KEYS",
    "ConnectorOptions",
    "ConnectorSetup",
    "connector_config",
    "prefix_hash",
    "rank_prefix",
    "unit_hashes",
    "unit_key",
]

# Keys of kv_connector_extra_config that belong to the connector rather than to TuttiConfig.
CONNECTOR_KEYS = ("load_async", "namespace", "partial_units", "defer_saves", "on_store_error")
# What the connector does when its store cannot open (ConnectorOptions.on_store_error).
ON_STORE_ERROR = ("fail", "serve_without_cache")


@dataclass(frozen=True)
class ConnectorOptions:
    """Connector settings that are not store settings.

    ``load``/``save`` follow ``kv_role``: a ``kv_producer`` only saves, a ``kv_consumer`` only loads,
    ``kv_both`` does both. ``load_async`` makes loads run between scheduler steps (vLLM's
    WAITING_FOR_REMOTE_KVS) instead of inside the step that needs them. ``namespace`` overrides the
    model identity mixed into every key (default: model path, dtype, block size, parallel layout).
    ``partial_units`` (default on) also stores each prompt's last, partial unit (its whole blocks),
    so a later prompt that extends it hits at block granularity instead of recomputing up to
    ``unit_tokens - 1`` tokens. ``defer_saves`` (default on) lets a step's writes run on past the
    step: the step ends without waiting for them, they complete while later steps (decode) run,
    and their units are committed then; a finished request keeps its blocks until its writes are
    done, and a preempted one's writes complete before its blocks are reused.
    ``on_store_error`` decides what happens when a worker's store cannot open (a missing, full or
    read-only path, a node daemon that refuses the instance): ``fail`` (the default) stops the
    engine with the cause; ``serve_without_cache`` starts it with the connector answering no hits
    and saving nothing, and a warning every minute until the engine restarts. Settings that can never
    work (``ConfigError``, ``LayoutError``) stop the engine either way.
    """

    load: bool = True
    save: bool = True
    load_async: bool = False
    namespace: str | None = None
    partial_units: bool = True
    defer_saves: bool = True
    on_store_error: str = "fail"


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
    conn = {k: extra.pop(k) for k in CONNECTOR_KEYS if k in extra}
    unknown = sorted(k for k in extra if k not in TuttiConfig.model_fields)
    if unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config keys {unknown}; allowed: "
            f"{sorted([*TuttiConfig.model_fields, *CONNECTOR_KEYS])}"
        )
    cfg = load_config(**extra)
    role = kv_role or "kv_both"
    if role not in ("kv_both", "kv_producer", "kv_consumer"):
        raise ConfigError(f"kv_role must be kv_both, kv_producer or kv_consumer, got {role!r}")
    ns = conn.get("namespace")
    if ns is not None and not isinstance(ns, str):
        raise ConfigError("kv_connector_extra_config.namespace must be a string")
    on_error = conn.get("on_store_error", os.environ.get("TUTTI_ON_STORE_ERROR") or "fail")
    if on_error not in ON_STORE_ERROR:
        raise ConfigError(f"kv_connector_extra_config.on_store_error must be one of {list(ON_STORE_ERROR)}, "
                          f"got {on_error!r}")
    opts = ConnectorOptions(
        load=role != "kv_producer",
        save=role != "kv_consumer",
        load_async=_as_bool("load_async", conn.get("load_async", False)),
        namespace=ns,
        partial_units=_as_bool("partial_units", conn.get("partial_units", True)),
        defer_saves=_as_bool("defer_saves", conn.get("defer_saves", True)),
        on_store_error=on_error,
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


def prefix_hash(block_hashes: list[Any], hash_block: int, tokens: int) -> bytes | None:
    """The hash naming the first ``tokens`` tokens of a prompt (a multiple of ``hash_block``): that
    of its last hash block, which names a unit ending there, whole or partial; None when the prompt
    has no such hash yet."""
    i = tokens // hash_block - 1
    return bytes(block_hashes[i]) if 0 <= i < len(block_hashes) else None


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
                getattr(mc, "quantization", None),
                _model_config_digest(mc),
            )
        )
    return hashlib.blake2b(f"tutti-vllm|{ident}|{unit_tokens}".encode(), digest_size=16).digest()


def _model_config_digest(mc: Any) -> str:
    """A digest of the model's effective configuration (its ``config.json`` with vLLM's
    ``hf_overrides`` applied: RoPE, attention and layer settings that change the KV of a prompt)."""
    hf = getattr(mc, "hf_config", None)
    if hf is None:
        return ""
    text = json.dumps(hf.to_dict(), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def rank_prefix(namespace: bytes, rank: int) -> bytes:
    """What every key of worker rank ``rank`` starts from: the namespace and the rank."""
    return namespace + rank.to_bytes(4, "little")


def unit_key(prefix: bytes, unit_hash: bytes) -> int:
    """The store key of the unit named ``unit_hash`` on the rank of ``prefix``."""
    return to_key(prefix + unit_hash)


# ---- what both roles derive at start ------------------------------------------------------------
@dataclass(frozen=True)
class ConnectorSetup:
    """The connector's configuration and geometry, the same in the scheduler and every worker."""

    config: TuttiConfig
    options: ConnectorOptions
    block_size: int  # tokens per vLLM block
    unit_tokens: int
    unit_blocks: int  # vLLM blocks per unit
    unit_hash_blocks: int  # vLLM hash blocks per unit
    hash_block: int  # tokens per vLLM hash block
    world: int  # worker ranks: tensor x pipeline parallel size
    namespace: bytes
    prefixes: tuple[bytes, ...]  # key prefix of each rank

    @property
    def tail_step(self) -> int:
        """Tokens a partial unit grows by: a whole vLLM block that is also whole hash blocks."""
        return max(self.block_size, self.hash_block)

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> ConnectorSetup:
        """Reads and checks the settings: :class:`ConfigError` when vLLM's block sizes do not divide
        ``unit_tokens``, the engine has more than one KV cache group, or vLLM frees the blocks of
        its group while their request runs (local attention only)."""
        tcfg = vllm_config.kv_transfer_config
        assert tcfg is not None
        config, options = connector_config(tcfg.kv_connector_extra_config, tcfg.kv_role)
        block_size = int(vllm_config.cache_config.block_size)
        unit_tokens = int(config.unit_tokens)
        if unit_tokens % block_size:
            raise ConfigError(
                f"unit_tokens ({unit_tokens}) must be a multiple of the vLLM block size ({block_size})"
            )
        hash_block = getattr(kv_cache_config, "hash_block_size", None) or block_size
        if unit_tokens % hash_block:
            raise ConfigError(
                f"unit_tokens ({unit_tokens}) must be a multiple of the hash block size ({hash_block})"
            )
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ConfigError("TuttiConnector supports one KV cache group (disable the hybrid KV cache manager)")
        if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
            _refuse_freed_running_blocks(kv_cache_config.kv_cache_groups[0])
        pc = vllm_config.parallel_config
        world = int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)
        namespace = _namespace(vllm_config, options, unit_tokens)
        return cls(
            config=config,
            options=options,
            block_size=block_size,
            unit_tokens=unit_tokens,
            unit_blocks=unit_tokens // block_size,
            unit_hash_blocks=unit_tokens // hash_block,
            hash_block=hash_block,
            world=world,
            namespace=namespace,
            prefixes=tuple(rank_prefix(namespace, r) for r in range(world)),
        )


def _refuse_freed_running_blocks(group: Any) -> None:
    """:class:`ConfigError` when vLLM's manager of ``group`` frees a running request's blocks.

    Sliding-window, chunked-local, circular-buffer, R-SWA and Mamba managers give the blocks that
    left the window back to the pool while their request runs (``remove_skipped_blocks``). A save
    moves whole units after the forward that computed them (with ``defer_saves``, in the next step),
    so such a block may by then hold another request's KV: the unit would be stored wrong under its
    key and served as a hit. Models whose every layer is local attention keep such a group even with
    the hybrid manager off (vLLM promotes local layers to full attention only beside full ones)."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    spec = group.kv_cache_spec
    manager = KVCacheSpecRegistry.get_manager_class(spec, getattr(group, "role", None))
    base = SingleTypeKVCacheManager
    if manager is None or (
        manager.remove_skipped_blocks is base.remove_skipped_blocks
        and manager.get_num_skipped_tokens is base.get_num_skipped_tokens
    ):
        return
    raise ConfigError(
        f"TuttiConnector cannot serve this model's KV cache ({type(spec).__name__}): vLLM's "
        f"{manager.__name__} frees a running request's blocks outside its attention window, and a "
        "unit saved after them could hold another request's KV. Models with full-attention layers "
        "beside their sliding-window ones are served (vLLM keeps every block of a request then)"
    )

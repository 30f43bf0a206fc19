"""The connector vLLM loads: :class:`TuttiConnector`, a front that dispatches by role.

vLLM makes one connector per process: the scheduler role in the engine-core process and the worker
role in each worker rank. The front reads the settings both roles share
(:class:`~tutti_cluster.vllm.config.ConnectorSetup`), builds the one role object its process needs
(:class:`~tutti_cluster.vllm.scheduler.TuttiScheduler` or
:class:`~tutti_cluster.vllm.worker.TuttiWorker`, the only holders of role state) and hands every
hook to it, with the step's metadata for the worker hooks. The class-level answers vLLM asks for
before any connector exists (stats and Prometheus classes, CUDA-graph mode, KV layout) are here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from tutti_cluster.vllm.config import ConnectorSetup
from tutti_cluster.vllm.metadata import TuttiConnectorMetadata
from tutti_cluster.vllm.metrics import TuttiConnectorStats, TuttiPromMetrics
from tutti_cluster.vllm.scheduler import TuttiScheduler
from tutti_cluster.vllm.worker import TuttiWorker

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

__all__ = ["TuttiConnector"]


def _log_where_vllm_logs() -> None:
    """Tutti's log lines (``tutti_cluster.*``: the connector's, the store's) go where vLLM's go, at
    vLLM's level and in its format. vLLM configures only its own ``vllm`` logger; without this,
    Python's root logger would show Tutti's warnings bare and its start-up line not at all.
    Nothing changes where the application configured logging itself (the root logger has a
    handler) or gave Tutti's logger one."""
    ours, theirs = logging.getLogger("tutti_cluster"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers or logging.getLogger().handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level)
    ours.propagate = False


class TuttiConnector(KVConnectorBase_V1):
    """KV connector that serves and persists prefix KV through a Tutti store (see the package docs)."""

    # Loads come from SSD-backed storage.
    if _DISK_SOURCE is not None:
        _cache_hit_source = _DISK_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        _log_where_vllm_logs()
        self.setup = ConnectorSetup.from_vllm(vllm_config, kv_cache_config)
        self.connector_scheduler: TuttiScheduler | None = None
        self.connector_worker: TuttiWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = TuttiScheduler(self.setup, vllm_config)
        else:
            self.connector_worker = TuttiWorker(self.setup, vllm_config, kv_cache_config)

    @property
    def scheduler(self) -> TuttiScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side hook called on a worker connector"
        return self.connector_scheduler

    @property
    def worker(self) -> TuttiWorker:
        assert self.connector_worker is not None, "a worker-side hook called on the scheduler connector"
        return self.connector_worker

    def _metadata(self) -> TuttiConnectorMetadata | None:
        """This step's metadata, once the model runner has bound it."""
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TuttiConnectorMetadata)
        return meta

    # ================================ scheduler role ================================
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.scheduler.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        # Every pipeline stage has its own store; all of them report their keys.
        self.scheduler.set_xfer_handshake_metadata({i: m for i, m in enumerate(metadata.values())})

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_push_work()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    # ================================ worker role ================================
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Before the step's forward (start_load_kv may run after it): writes still reading blocks
        # that the scheduler has just freed (preempted requests) are completed here.
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None and isinstance(connector_metadata, TuttiConnectorMetadata):
            self.connector_worker.before_step(connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.connector_worker.get_handshake_metadata() if self.connector_worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, self._metadata())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()

    # ================================ both roles ================================
    def shutdown(self) -> None:
        if getattr(self, "connector_worker", None) is not None:
            self.worker.shutdown()
        if getattr(self, "connector_scheduler", None) is not None:
            self.scheduler.shutdown()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        role = self.connector_scheduler if self.connector_scheduler is not None else self.connector_worker
        return role.take_stats() if role is not None else None

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

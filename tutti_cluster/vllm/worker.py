"""The worker side of the connector (one per GPU/CPU worker rank): :class:`TuttiWorker`.

It opens one :class:`~tutti_cluster.TuttiStore` instance per rank (``<instance>-r<rank>``, with
``-dp<rank>`` under data parallelism), registers vLLM's paged KV tensors and maps the layer-wise
hooks onto the store: ``start_load_kv``/``wait_for_layer_load`` onto ``begin_retrieve``,
``retrieve_layer`` and ``wait_layer``; ``save_kv_layer``/``wait_for_save`` onto ``begin_store`` and
the pipeline's :class:`~tutti_cluster.pipeline.scheduler.SlackScheduler`, which writes a layer
(``store_layer``) only into slack and commits with ``finish``. ``wait_for_save`` ends the step: every
load begun in it is finished there (or, for asynchronous loads, in ``get_finished``). A save's layers
are handed to its scheduler as the forward finishes them; the connector knows no slack window of the
engine's forward, so none is written beside it: with ``defer_saves`` (the default) the writes go in
the next step, at its ``start_load_kv`` (the scheduler's decode step: the step that computed them, and
so the first token, never waits for or shares the device with them). vLLM calls ``start_load_kv``
before the forward when the step loads synchronously, otherwise right after launching the forward,
so on a GPU the writes run beside it either way. Each later step finishes
(commits) the saves whose I/O is done, without waiting; without ``defer_saves`` they are written and
finished at the end of their step. A finished request's blocks stay held (the scheduler) until its
writes are done, and ``before_step`` completes the writes of a preempted request before the step's
forward can reuse its blocks. So vLLM never frees a block under an unfinished I/O, and the store
gets its pins, slots and IOCBs back.

Errors never reach the engine and never count as loaded: a load that cannot begin, a load with any
failed layer call or wait, and the units the store reports failed are returned by
``get_block_ids_with_load_errors`` (the failed unit and everything after it) and, per request, in
the worker metadata, so the scheduler saves them again once vLLM has recomputed them. A save that
fails is dropped (a future miss); one with a layer that did not move commits nothing.

The store's commits and evictions go to the scheduler in the worker metadata after each step, and to
the node daemon (``tutti up``) when one runs. In cluster mode the units past the local prefix are
fetched from their owners over the Transfer Engine, placed straight into the KV blocks (checksums
verified), and kept as a local replica.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tutti_cluster.config import TuttiConfig, check_instance_name
from tutti_cluster.errors import CapacityExceeded, ConfigError, LayoutError, StorageError, TuttiError
from tutti_cluster.kv_layout import LayerKV, layer_kv_from_vllm
from tutti_cluster.pipeline.scheduler import SlackScheduler
from tutti_cluster.vllm.config import ConnectorSetup, rank_prefix, unit_key
from tutti_cluster.vllm.logs import BoundedLog, Reminder, banner, describe_failures, describe_pools
from tutti_cluster.vllm.metadata import Transfer, TuttiConnectorMetadata, TuttiHandshake, TuttiWorkerMetadata
from tutti_cluster.vllm.metrics import STORE_COUNTERS, STORE_GAUGES, TuttiConnectorStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tutti_cluster.store import UnitFailure

log = logging.getLogger("tutti_cluster.vllm")  # one logger for every part of the connector

__all__ = ["TuttiWorker"]


@dataclass
class _InFlight:
    transfer: Transfer
    handle: int
    keys: list[int]
    error: bool = False  # a layer call or wait failed: nothing of it counts as loaded (or saved)
    inner: list[list[int]] | None = None  # saves: each unit's inner keys
    sched: SlackScheduler | None = None  # saves: places the layers' writes


class TuttiWorker:
    """The connector's worker role: this rank's store and the step's loads and saves (module docs)."""

    def __init__(self, setup: ConnectorSetup, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
        self.setup = setup
        self.config = setup.config
        self.options = setup.options
        self.unit_blocks = setup.unit_blocks
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._stats = TuttiConnectorStats()
        self.store: Any = None
        self.rank = 0
        self.prefix = b""  # this rank's key prefix, set with the rank in register_kv_caches
        self._layer_index: dict[str, int] = {}
        self._owner_layer: dict[str, bool] = {}
        self._loads: list[_InFlight] = []
        self._async: list[_InFlight] = []
        self._saves: list[_InFlight] = []
        self._writing: list[_InFlight] = []  # saves whose writes run on past their step (defer_saves)
        self._saves_started = False
        self._saved_layers: set[int] = set()
        self._invalid: set[int] = set()
        self._finished_recving: set[str] = set()
        self._finished_sending: set[str] = set()
        self._finishing: list[str] = []
        self._committed: list[int] = []
        self._inner: dict[int, list[int]] = {}  # committed unit key -> its inner keys, for the scheduler
        self._evicted: list[int] = []
        self._failed: dict[str, int] = {}
        self._link: Any = None  # the node daemon's socket, when a daemon runs
        self._cluster: Any = None  # remote fetches, in cluster mode
        self._store_seen: dict[str, int] = {}  # the store's counters and gauges as last reported
        # Operator-facing: failures logged at most 10 a minute per kind, with their cause.
        self._load_warnings = BoundedLog(log)
        self._store_warnings = BoundedLog(log)
        self.store_error: str | None = None  # why the store did not open (on_store_error: serve_without_cache)
        self._reminder: Reminder | None = None
        self._daemon_note = "no node daemon"
        # What the node daemon shows as this instance's lookups and hits (units): the scheduler's
        # lookups come with each step's metadata, the hits are the units loaded.
        self.lookup_units = 0
        self.hit_units = 0

    def take_stats(self) -> TuttiConnectorStats | None:
        # The store's counters (direct I/Os, per-tier hits, flushes) follow loads and saves, which
        # count here as they finish: a quiet interval skips the store's stats (an idle step pays
        # nothing), a later one takes the difference. Gauges go as their change, too (metrics.py).
        if self.store is not None and not self._stats.is_empty():
            st = self.store.stats()
            for name in (*STORE_COUNTERS, *STORE_GAUGES):
                n = int(st.get(name, 0))
                self._stats.add(name, n - self._store_seen.get(name, 0))
                self._store_seen[name] = n
        return self._stats.take()

    # ---- start ----------------------------------------------------------------------------------
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

        assert self._kv_cache_config is not None
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
        instance = check_instance_name(f"{self.config.instance}-r{self.rank}")  # its pool files' name
        if int(getattr(pc, "data_parallel_size", 1)) > 1:
            instance += f"-dp{int(getattr(pc, 'data_parallel_rank', 0))}"
        cfg = self.config.model_copy(update={"instance": instance})
        prefixes = self.setup.prefixes
        self.prefix = prefixes[self.rank] if self.rank < len(prefixes) else rank_prefix(self.setup.namespace, self.rank)
        try:
            self.store = TuttiStore(cfg)
            self.store.register_kv_caches(layers, block_tokens=self.setup.block_size)
            self._attach_node(cfg)
        except (TuttiError, OSError) as e:
            self._store_failed(cfg, e)
            return
        st = self.store.stats()
        from tutti_cluster import __version__

        mode = (f"cluster mode (etcd {','.join(cfg.etcd)}, node {cfg.node_id or 'the host name'})" if cfg.etcd
                else "single node")
        log.info("%s", banner(version=__version__, rank=self.rank, instance=instance, backend=str(st["backend"]),
                              pools=describe_pools(cfg),
                              unit_tokens=self.setup.unit_tokens, block_size=self.setup.block_size,
                              units=int(st["units"]), layers=len(layers), daemon=self._daemon_note, cluster=mode,
                              direct_io=bool(st["direct_io"])))
        kv0 = next(iter(kv_caches.values()))
        kv0 = kv0[0] if isinstance(kv0, (tuple, list)) else kv0
        if kv0.device.type == "cpu" and kv0.data_ptr() % 4096:
            log.info("Tutti connector: vLLM's KV cache is not page-aligned, so disk reads go through "
                     "staging; start vLLM with THP_MEM_ALLOC_ENABLE=1 to read straight into it (docs/VLLM.md)")

    def _store_failed(self, cfg: TuttiConfig, e: BaseException) -> None:
        """The store did not open: stop the engine with the cause first (``on_store_error: fail``),
        or serve without the cache (``serve_without_cache``). Settings that can never work
        (ConfigError, LayoutError) stop it either way."""
        if self.store is not None:
            try:
                self.store.close()
            except TuttiError:
                pass
            self.store = None
        if self._link is not None:
            self._link.close()
            self._link = None
        caps = cfg.capacity_bytes()
        where = ", ".join(f"{p} ({c / (1 << 30):g} GiB = {c} bytes)" for p, c in zip(cfg.storage_paths(), caps))
        if cfg.memory_paths:
            where += "; memory tier: " + ", ".join(f"{p} ({c / (1 << 30):g} GiB = {c} bytes)"
                                                   for p, c in zip(cfg.memory_paths, cfg.memory_capacity_bytes()))
        cause = str(e) if isinstance(e, TuttiError) else f"{type(e).__name__}: {e}"
        msg = (f"{cause} (instance {cfg.instance}; capacity_gb per path: {where}; on a memory file system "
               f"(tmpfs) each path's capacity is split into up to 16 pool files unless pool_files says otherwise)")
        fatal = isinstance(e, (ConfigError, LayoutError))
        if self.options.on_store_error != "serve_without_cache" or fatal:
            hint = "" if fatal else "; set on_store_error: serve_without_cache to serve without the cache instead"
            log.error("Tutti connector rank %d: the KV store could not open: %s%s", self.rank, msg, hint)
            cls = type(e) if isinstance(e, TuttiError) else StorageError
            raise cls(f"the Tutti KV store could not open: {msg}{hint}") from None
        self.store_error = msg
        note = (f"Tutti connector rank {self.rank}: serving WITHOUT the KV cache (on_store_error: "
                f"serve_without_cache): the store could not open: {msg}. No prefix is restored or saved "
                "until the engine restarts")
        log.warning("%s", note)
        self._reminder = Reminder(log, note)

    def _attach_node(self, cfg: TuttiConfig) -> None:
        """Announces the store to the node daemon (when one runs) and, in cluster mode, opens the
        remote-fetch client. The daemon registers committed units in the cluster directory."""
        from tutti_cluster.node.link import DaemonLink

        link = DaemonLink(cfg)
        try:
            attached = link.attach(self.store)
        except BaseException:
            link.close()
            raise
        if attached is not None or link.pending:  # pending: the daemon is there, busy
            self._link = link
            link.extra_stats = self._daemon_counters
            self._daemon_note = (f"node daemon {'attached' if attached is not None else 'busy, attaching'} "
                                 f"({link.path})")
            to_daemon_commit, to_daemon_evict = self.store.on_commit, self.store.on_evict
        else:
            link.close()
            to_daemon_commit = to_daemon_evict = None
            self._daemon_note = f"no node daemon at {link.path}: working alone"

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

    def _daemon_counters(self) -> dict[str, int]:
        """Added to the store's counters in the node daemon's view (DaemonLink.extra_stats)."""
        return {"lookups": self.lookup_units, "hits": self.hit_units}

    def get_handshake_metadata(self) -> TuttiHandshake | None:
        if self.store is None:
            if self.store_error is not None:  # serving without the cache: the scheduler asks for nothing
                return TuttiHandshake(rank=self.rank, keys=[], store_error=self.store_error)
            return None
        return TuttiHandshake(rank=self.rank, keys=self.store.keys(), inner=self.store.inner_keys())

    # ---- loads ----------------------------------------------------------------------------------
    def _begin(self, t: Transfer, load: bool) -> _InFlight | None:
        keys = [unit_key(self.prefix, h) for h in t.hashes]
        if load and t.tail_keys:
            keys[-1] = t.tail_keys[self.rank]  # another prompt's unit, found by an inner key
        inner = None if load or t.inner is None else [[unit_key(self.prefix, b) for b in bs] for bs in t.inner]

        def begin() -> int:
            if load:
                return self.store.begin_retrieve(keys, t.block_ids)
            return self.store.begin_store(keys, t.block_ids, inner)

        try:
            try:
                h = begin()
            except CapacityExceeded:
                if not self._writing:
                    raise
                # Earlier steps' writes hold IOCBs or request slots: end them, then once more.
                self._settle_writes(wait=True)
                h = begin()
        except TuttiError as e:
            warn = self._load_warnings if load else self._store_warnings
            warn.warning("Tutti %s of request %s (%d units, first key %016x) not started: %s", "load" if load else "store",
                         t.req_id, len(keys), keys[0] if keys else 0, e)
            if load:
                self._invalid.update(t.written())
                self._failed[t.req_id] = min(t.first_unit, self._failed.get(t.req_id, t.first_unit))
                self._stats.add("load_failed_units", len(keys))
            else:
                self._stats.add("store_failed_units", len(keys))
            return None
        return _InFlight(t, h, keys, inner=inner)

    def start_load_kv(self, meta: TuttiConnectorMetadata | None) -> None:
        """Hands each request's units to the store and starts every layer's retrieve."""
        if meta is None:
            return
        if self.store is None:  # serving without the cache: nothing loads (the scheduler asks for none)
            for t in meta.loads + meta.async_loads:
                self._invalid.update(t.written())
                self._failed[t.req_id] = min(t.first_unit, self._failed.get(t.req_id, t.first_unit))
            self._finished_recving.update(t.req_id for t in meta.async_loads)
            return
        self._write_deferred()
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
                    self._load_warnings.warning("Tutti load of request %s failed to start: %s", t.req_id, e)
                    f.error = True
                sink.append(f)  # finished in any case: the store holds its pins and IOCBs until then

    def _fetch_remote(self, t: Transfer) -> Transfer:
        """Places the transfer's remote units (other nodes' SSDs, over the Transfer Engine) into their
        blocks, keeping a local replica; returns the local part, to load through the store."""
        assert t.remote_from is not None
        ub, r = self.unit_blocks, t.remote_from
        keys = [unit_key(self.prefix, h) for h in t.hashes[r:]]
        placed = 0
        if self._cluster is not None:
            try:
                placed = self._cluster.retrieve_remote(keys, t.block_ids[r * ub :], keep_replica=True)
            except TuttiError as e:
                self._load_warnings.warning("Tutti remote fetch for request %s failed: %s", t.req_id, e)
        self._stats.add("remote_units", placed)
        self.hit_units += placed
        if placed < len(keys):
            self._invalid.update(t.written((r + placed) * ub))
            unit = t.first_unit + r + placed
            self._failed[t.req_id] = min(unit, self._failed.get(t.req_id, unit))
            self._stats.add("load_failed_units", len(keys) - placed)
        return Transfer(t.req_id, t.hashes[:r], t.block_ids[: r * ub], t.first_unit)

    def wait_for_layer_load(self, layer_name: str) -> None:
        idx = self._layer_index.get(layer_name)
        if idx is None or not self._loads:
            return
        t0 = time.perf_counter()
        for f in self._loads:
            try:
                self.store.wait_layer(idx, f.handle)
            except TuttiError as e:
                self._load_warnings.warning("Tutti load of request %s, layer %d: %s", f.transfer.req_id, idx, e)
                f.error = True
        # The forward's stall on storage: zero where every layer lands before the engine needs it.
        self._stats.add("load_wait_us", round((time.perf_counter() - t0) * 1e6))

    def _finish_loads(self, flights: list[_InFlight]) -> None:
        for f in flights:
            failures: list[UnitFailure] = []
            try:
                res = self.store.finish(f.handle)
                failed, failures = sorted(res.failed_units), res.failures
                why = describe_failures(failures)
            except TuttiError as e:
                failed, why = [0], f"the request failed: {e}"
            if f.error:  # a layer of it did not move (or was not waited for): no block is loaded
                failed = [0]
                why = why or "a layer of the request did not move (logged above)"
            if failed:
                self._load_warnings.warning(
                    "Tutti: load of request %s failed from unit %d of %d (key %016x, %d units recomputed): %s",
                    f.transfer.req_id, failed[0], len(f.keys), f.keys[failed[0]] if failed[0] < len(f.keys) else 0,
                    len(f.keys) - failed[0], why)
                # vLLM keeps the prefix before the first invalid block and recomputes the rest.
                first = failed[0]
                bad = f.transfer.written(first * self.unit_blocks)
                self._invalid.update(bad)
                self._drop_saves_over(set(bad))
                req_id, unit = f.transfer.req_id, f.transfer.first_unit + first
                self._failed[req_id] = min(unit, self._failed.get(req_id, unit))
                self._stats.add("load_failed_units", len(f.keys) - first)
                self._stats.add("load_units", first)
                self.hit_units += first
            else:
                self._stats.add("load_units", len(f.keys))
                self.hit_units += len(f.keys)

    def _finish_step_loads(self) -> None:
        """Finishes this step's (synchronous) loads, whose every layer the forward has waited for."""
        if self._loads:
            self._finish_loads(self._loads)
            self._loads = []

    def _drop_saves_over(self, blocks: set[int]) -> None:
        """A failed load may have left wrong bytes in ``blocks``, some of which other requests share
        through vLLM's prefix cache: no save that has yet to write them commits (vLLM recomputes
        them; the units are later misses). No save was writing them when the load began: a load writes
        only blocks newly allocated to its request (those vLLM's prefix cache holds are skipped)."""
        for f in self._saves + self._writing:
            if not f.error and blocks.intersection(f.transfer.block_ids):
                log.info("Tutti: the save of request %s is dropped: a failed load shares its blocks",
                         f.transfer.req_id)
                f.error = True

    # ---- saves ----------------------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, meta: TuttiConnectorMetadata | None) -> None:
        """Starts writing this layer of the units completed in this step (their KV is now in place)."""
        if self.store is None or not self._owner_layer.get(layer_name, False):
            return
        if not self._saves_started:
            self._start_saves(meta)
        idx = self._layer_index[layer_name]
        if idx in self._saved_layers or not self._saves:
            return
        self._saved_layers.add(idx)
        for f in self._saves:
            if f.sched is not None:
                f.sched.after_layer(idx)  # final now: written in slack, not beside this forward

    def _start_saves(self, meta: TuttiConnectorMetadata | None) -> None:
        self._saves_started = True
        if meta is None:
            return
        for t in meta.saves:
            if t.finish:
                self._finishing.append(t.req_id)
            if not t.hashes:
                continue
            f = self._begin(t, load=False)
            if f is not None:
                layers = self.store.num_layers
                # No slack window of the engine's forward is known: every write goes to later steps,
                # all of the save's layers in the first (one decode step's window holds them).
                f.sched = SlackScheduler(self.store, layers=layers, windows=[0.0] * layers, read_req=None,
                                         read_ioctx=0, read_seconds_per_ioctx=0.0, write_req=f.handle,
                                         write_seconds_per_layer=1.0, decode_window=float(layers), reads="layer")
                self._saves.append(f)

    def wait_for_save(self, meta: TuttiConnectorMetadata | None) -> None:
        """Ends the step: finishes the loads and writes it started, so no block is freed under an I/O."""
        if self.store is None:
            # Serving without the cache: nothing is written, finished requests are done at once.
            if meta is not None:
                self._finished_sending.update(t.req_id for t in meta.saves if t.finish)
            return
        if not self._saves_started:
            self._start_saves(meta)
        self._finish_step_loads()  # after the saves begin, so that a failed load drops those over its blocks
        # Earlier steps' saves, in a step that had no start_load_kv (no forward): written now.
        self._write_deferred()
        for f in self._saves:
            assert f.sched is not None
            # Layers that had no save_kv_layer call this step (no forward) are complete now.
            for layer in range(self.store.num_layers):
                if layer not in self._saved_layers:
                    f.sched.after_layer(layer)
            if self.options.defer_saves:
                self._writing.append(f)  # written in the next step; finished by a later one
            else:
                self._finish_save(f)
        self._saves = []
        self._saves_started = False
        self._saved_layers = set()
        self._settle_writes(wait=False)
        self._report_finished()

    def _write_deferred(self) -> None:
        """A later step: each save's scheduler writes what fits the step (its decode window)."""
        for f in self._writing:
            if f.sched is not None and f.sched.pending_writes and not f.error:
                try:
                    f.sched.decode_step()
                except TuttiError as e:  # never into the engine: the save is dropped
                    self._store_warnings.warning("Tutti store of request %s failed: %s", f.transfer.req_id, e)
                    f.error = True

    def _finish_save(self, f: _InFlight) -> None:
        """Writes what is left of a save and finishes it, always, so that its slots and IOCBs go
        back; a request with a layer that did not move commits nothing."""
        try:
            if f.error or f.sched is None:
                res = self.store.finish(f.handle)
                committed, skipped, failed_units = sorted(res.committed_units), res.skipped_units, list(res.failed_units)
                failures = res.failures
            else:
                report = f.sched.flush()
                committed, skipped, failed_units = (report.committed_units, report.skipped_units,
                                                    list(report.not_stored_units))
                failures = report.failures
            failed = len(failed_units)
        except TuttiError as e:
            self._store_warnings.warning("Tutti store of request %s (%d units, first key %016x) failed: %s",
                                         f.transfer.req_id, len(f.keys), f.keys[0] if f.keys else 0, e)
            if not f.error and f.sched is not None:
                f.error = True
                self._finish_save(f)  # a write that failed to start: finish what was issued
                return
            self._stats.add("store_failed_units", len(f.keys))
            return
        self._stats.add("store_units", len(committed))
        if f.inner:
            self._inner.update({f.keys[u]: f.inner[u] for u in committed if f.inner[u]})
        self._stats.add("store_skipped_units", skipped)
        self._stats.add("store_failed_units", failed)
        if failed and not f.error:  # a dropped save (over a failed load) is no store failure
            self._store_warnings.warning("Tutti: %d of %d units of request %s were not stored: %s", failed, len(f.keys),
                                         f.transfer.req_id, describe_failures(failures) or "no cause reported")

    def _settle_writes(self, wait: bool, req_ids: set[str] | None = None) -> None:
        """Finishes the saves whose writes are all issued and done (``wait``: all of them, writing
        what is left and waiting), or only those of ``req_ids``, waiting."""
        keep: list[_InFlight] = []
        for f in self._writing:
            if req_ids is not None:
                ready = f.transfer.req_id in req_ids
            elif wait or f.error or f.sched is None:
                ready = True
            else:
                try:
                    ready = not f.sched.pending_writes and self.store.done(f.handle)
                except TuttiError:
                    ready = True  # finish reports it
            if ready:
                self._finish_save(f)
            else:
                keep.append(f)
        self._writing = keep

    def _report_finished(self) -> None:
        """Finished requests whose writes are all done: vLLM may free their blocks now."""
        writing = {f.transfer.req_id for f in self._writing}
        self._finished_sending.update(r for r in self._finishing if r not in writing)
        self._finishing = [r for r in self._finishing if r in writing]

    def before_step(self, meta: TuttiConnectorMetadata) -> None:
        """Runs when the step's metadata is bound, before its forward: the writes of requests the
        scheduler preempted (their blocks are free and may be reallocated in this step) complete now;
        blocks the scheduler found holding a failed load's KV are reported as this step's load errors."""
        self._invalid.update(meta.invalid_blocks)
        self.lookup_units += meta.lookup_units
        if self.store is not None and meta.preempted and self._writing:
            self._settle_writes(wait=True, req_ids=set(meta.preempted))

    # ---- after the step -------------------------------------------------------------------------
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
        """The blocks of this step's failed loads. With speculative decoding vLLM asks before
        ``wait_for_save`` (which it defers past the draft model's forward): the loads, whose every
        layer the forward has waited for, are finished here, so that a failure is reported in the
        step whose output it would corrupt, never in a later one."""
        self._finish_step_loads()
        out, self._invalid = self._invalid, set()
        return out

    def build_connector_worker_meta(self) -> TuttiWorkerMetadata | None:
        if not self._committed and not self._evicted and not self._failed:
            return None
        meta = TuttiWorkerMetadata(self._committed[:], self._evicted[:], self._failed, self._inner)
        self._inner = {}
        self._committed.clear()
        self._evicted.clear()
        self._failed = {}
        return meta

    def shutdown(self) -> None:
        if self._reminder is not None:
            self._reminder.stop()
            self._reminder = None
        self._load_warnings.flush()
        self._store_warnings.flush()
        if self.store is not None:
            self._settle_writes(wait=True)  # nothing written is dropped
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None
        if self._link is not None:
            self._link.flush()
            self._link.close()
            self._link = None
        if self.store is not None:
            self.store.close()
            self.store = None

"""tutti itself, driven through the public TuttiStore API exactly as an engine drives it."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tutti_cluster.bench import fsutil
from tutti_cluster.bench.common import OpTiming, Round
from tutti_cluster.bench.errors import BenchVerificationError
from tutti_cluster.bench.kvdata import KVData
from tutti_cluster.config import TuttiConfig, load_config
from tutti_cluster.kv_layout import Layout

logger = logging.getLogger(__name__)

# Room left in the pool beyond one prefix: headers, rounding to whole units per path.
_POOL_SLACK = 1.10
_POOL_EXTRA_BYTES = 256 << 20


def open_store(fields: dict[str, Any], kv: Any, block_tokens: int, layout: Layout = "auto") -> Any:
    """A store of the config ``fields`` for the KV cache ``kv`` (its ``layers``, on ``kv.device``,
    whose type picks the backend), with the KV registered; closed again when that fails."""
    from tutti_cluster import TuttiStore

    fields = {**fields, "backend": "cuda" if kv.device.type == "cuda" else "cpu"}
    if kv.device.type == "cuda" and kv.device.index is not None:
        fields["device"] = kv.device.index
    store = TuttiStore(load_config(**fields))
    try:
        store.register_kv_caches(kv.layers, block_tokens=block_tokens, layout=layout)
    except BaseException:
        store.close()
        raise
    return store


def pool_bytes_per_path(prefix_bytes: int, n_paths: int) -> int:
    """Pool capacity per path that holds one prefix of ``prefix_bytes`` with room to spare."""
    return int(prefix_bytes * _POOL_SLACK / n_paths) + _POOL_EXTRA_BYTES


class TuttiSystem:
    """One TuttiStore per prefix length, on its own sub-directory of each path.

    ``tutti`` moves every object through the host agent and io_uring, memory file systems included
    (there /dev/shm stands in for an NVMe array); ``tutti-mapped`` sets ``map_memory_paths``, so that
    the I/O kernel copies objects straight between mapped tmpfs pool files and the KV blocks
    (byte-addressable storage). ``tutti-memory`` (``memory`` given) puts a memory tier on those
    directories in front of ``dirs``: a store commits into memory (``write_back``: the flusher
    copies it to ``dirs`` in the background; ``memory_only``: never) and, before each timed retrieve, the flush is waited
    for and every unit is checked to lie in memory (:meth:`TuttiStore.unit_tiers`), so that the
    retrieve reads a hot set held in memory (``promote_hits`` 0: reads move nothing).

    ``store``: ``begin_store`` once, ``store_layer`` per layer, ``wait_layer`` per layer, ``finish``.
    ``retrieve``: ``begin_retrieve`` once, ``retrieve_layer`` for every layer, then ``wait_layer``
    per layer, ``finish``.  ``engine_cpu_s`` is the calling thread's CPU time inside the
    ``store_layer``/``retrieve_layer`` calls only.
    """

    ops: tuple[str, ...] = ("store", "retrieve")

    def __init__(
        self,
        kv: KVData,
        cfg: TuttiConfig,
        dirs: Sequence[Path],
        capacity_gb: list[float] | None,
        seed: int,
        mapped: bool = False,
        memory: Sequence[Path] | None = None,
        memory_capacity_gb: list[float] | None = None,
        write_policy: str = "write_back",
    ) -> None:
        self.name = "tutti-memory" if memory else "tutti-mapped" if mapped else "tutti"
        self.kv = kv
        self._base_cfg = cfg
        self._mapped = mapped
        self._dirs = [d / self.name for d in dirs]
        self._memory = [d / self.name for d in memory or ()]
        self._capacity_gb = capacity_gb
        self._memory_capacity_gb = memory_capacity_gb
        self._write_policy = write_policy if memory else "write_back"
        self._rng = np.random.default_rng(seed ^ 0x7A77)
        self._store: Any = None
        self._n_blocks = 0
        self._instances = 0
        self._keys: dict[str, list[int]] = {}
        self.stats: dict[str, Any] = {}

    def _open(self, n_blocks: int) -> None:
        """(Re)open a store sized for ``n_blocks``-block prefixes, with the KV tensors registered."""
        self._close_store()
        for d in [*self._dirs, *self._memory]:
            d.mkdir(parents=True, exist_ok=True)
        prefix_bytes = n_blocks * self.kv.shape.block_bytes
        caps = self._capacity_gb or [pool_bytes_per_path(prefix_bytes, len(self._dirs)) / (1 << 30)]
        self._instances += 1
        fields = self._base_cfg.model_dump()
        fields.update(
            paths=self._dirs,
            capacity_gb=caps,
            instance=f"bench{self._instances}",
            map_memory_paths=self._mapped or bool(self._memory),
            memory_paths=self._memory,
            write_policy=self._write_policy,
        )
        if self._memory:
            mem = self._memory_capacity_gb or [pool_bytes_per_path(prefix_bytes, len(self._memory)) / (1 << 30)]
            fields.update(memory_capacity_gb=mem, promote_hits=0)
        self._store = open_store(fields, self.kv, self.kv.shape.block_tokens)
        self._n_blocks = n_blocks

    def _keys_for(self, rnd: Round) -> list[int]:
        unit_blocks = int(self._store.unit_blocks)
        if rnd.n_blocks % unit_blocks:
            raise ValueError(f"a prefix of {rnd.n_blocks} blocks is not a whole number of {unit_blocks}-block units")
        keys = [int(k) for k in self._rng.integers(1, 2**63 - 1, size=rnd.n_blocks // unit_blocks)]
        self._keys[rnd.tag] = keys
        return keys

    def _sync(self) -> None:
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)

    def prepare(self, rnd: Round) -> None:
        if self._store is None or self._n_blocks != rnd.n_blocks:
            self._open(rnd.n_blocks)

    def _run_layers(self, h: int, issue: Callable[[int, int], None]) -> tuple[Any, tuple[float, ...]]:
        """Issues every layer of request ``h`` (timing the engine thread's CPU inside each of those
        calls, in us), waits for each layer, and finishes the request."""
        store = self._store
        calls = []
        for layer in range(self.kv.shape.layers):
            t0 = time.thread_time_ns()
            issue(layer, h)
            calls.append(time.thread_time_ns() - t0)
        for layer in range(self.kv.shape.layers):
            store.wait_layer(layer, h)
        res = store.finish(h)
        self._sync()
        return res, tuple(c / 1e3 for c in calls)

    def store(self, rnd: Round) -> OpTiming:
        store = self._store
        keys = self._keys_for(rnd)
        res, calls = self._run_layers(store.begin_store(keys, rnd.store_ids.tolist()), store.store_layer)
        if res.failed_units:
            raise BenchVerificationError(f"tutti: store of {len(res.failed_units)} of {len(keys)} units failed")
        return OpTiming(engine_cpu_s=sum(calls) / 1e6, call_cpu_us=calls)

    def before_read(self, rnd: Round) -> None:
        # Reads are O_DIRECT where the file system allows it; evicting the pool files also covers
        # a path that fell back to buffered I/O (on tmpfs this is a no-op: memory is the storage).
        fsutil.evict(p for d in self._dirs for p in d.iterdir() if p.is_file())
        if self._memory:  # no flush beside the timed read, and the hot set in memory
            check_tiers(self._store, self._keys[rnd.tag], ("memory", "both"), self.name)

    def retrieve(self, rnd: Round) -> OpTiming:
        store = self._store
        keys = self._keys[rnd.tag]
        hit = store.lookup(keys)
        if hit != len(keys):
            raise BenchVerificationError(f"tutti: lookup found {hit} of {len(keys)} stored units")
        res, calls = self._run_layers(store.begin_retrieve(keys, rnd.retrieve_ids.tolist()), store.retrieve_layer)
        if res.failed_units:
            raise BenchVerificationError(f"tutti: {len(res.failed_units)} of {len(keys)} units failed to load")
        return OpTiming(engine_cpu_s=sum(calls) / 1e6, call_cpu_us=calls)

    def end_round(self, rnd: Round) -> None:
        self._keys.pop(rnd.tag, None)
        try:
            self.stats = dict(self._store.stats())
        except Exception:  # noqa: BLE001 - stats are informational only
            logger.debug("store stats unavailable", exc_info=True)

    def release(self) -> None:
        self._close_store()  # prepare() opens a new one for the next prefix

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        for d in [*self._dirs, *self._memory]:
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        self._close_store()


def check_tiers(store: Any, keys: Sequence[int], want: Sequence[str], what: str, timeout_s: float = 600.0) -> None:
    """Waits for the memory tier's background copies (``flush``), then checks that every unit of
    ``keys`` lies where ``want`` says (:meth:`TuttiStore.unit_tiers`); BenchVerificationError otherwise."""
    if not store.flush(timeout_s=timeout_s):
        raise BenchVerificationError(f"{what}: the memory tier's flush did not end within {timeout_s:g} s")
    tiers = store.unit_tiers(keys)
    wrong = [t for t in tiers if t not in want]
    if wrong:
        raise BenchVerificationError(
            f"{what}: {len(wrong)} of {len(keys)} units lie in {sorted(set(wrong))}, not in {' or '.join(want)} "
            "(the memory tier too small for them?)")

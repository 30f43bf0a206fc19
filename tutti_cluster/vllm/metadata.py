"""What the two roles tell each other, through vLLM.

- :class:`TuttiConnectorMetadata`, scheduler -> workers once per step (``build_connector_meta``,
  bound by the model runner before the step): the loads and saves of the step, each a
  :class:`Transfer` of units with their block ids.
- :class:`TuttiWorkerMetadata`, workers -> scheduler once per step (``build_connector_worker_meta``,
  summed over ranks with ``aggregate``, read in ``update_connector_output``): the keys committed (with
  their inner keys) and evicted, and each request's first unit that failed to load.
- :class:`TuttiHandshake`, each worker -> scheduler once at start (``get_handshake_metadata``,
  ``set_xfer_handshake_metadata``): the keys its store found on disk, and their inner keys (or
  why its store did not open, when the engine serves without the cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

# A load's block id for a block the store checks with its unit and leaves as it is (the value of
# tutti_cluster.store.SKIP_BLOCK, which this module does not import: the scheduler process has no store).
SKIP_BLOCK = -1

__all__ = ["SKIP_BLOCK", "Transfer", "TuttiConnectorMetadata", "TuttiHandshake", "TuttiWorkerMetadata"]


@dataclass
class Transfer:
    """One request's units to move this step: ``hashes[i]`` names unit ``i``; its blocks are
    ``block_ids[i * unit_blocks : (i + 1) * unit_blocks]``, except that the last unit may hold fewer
    (a prompt's partial last unit). A load's first unit may name its leading blocks
    :data:`SKIP_BLOCK`: vLLM's prefix cache holds them, so they are checked and not written."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    first_unit: int = 0  # index of unit 0 of this transfer in the request's prompt
    remote_from: int | None = None  # loads: units from this index on come from other nodes
    finish: bool = False  # saves: the request has finished; report it once the save is done
    # Saves: per unit, the hashes at its inner block boundaries (stored as the unit's inner keys).
    inner: list[list[bytes]] | None = None
    # Loads: per rank, the store key of the last unit, when it is found by an inner key (another
    # prompt's unit, whose own hash the scheduler does not know); its entry in ``hashes`` is unused.
    tail_keys: list[int] | None = None

    def written(self, start: int = 0) -> list[int]:
        """The block ids from index ``start`` on that the transfer writes (not :data:`SKIP_BLOCK`)."""
        return [b for b in self.block_ids[start:] if b != SKIP_BLOCK]


@dataclass
class TuttiConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[Transfer] = field(default_factory=list)
    async_loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    # Requests preempted in this step's scheduling: their blocks are free, so a write still
    # reading them completes before the forward reuses them (TuttiWorker.before_step).
    preempted: list[str] = field(default_factory=list)
    # Blocks of a failed load still in vLLM's prefix cache that a request of this step reads as
    # computed: reported as failed loads of this step (TuttiWorker.before_step).
    invalid_blocks: list[int] = field(default_factory=list)
    # Units the scheduler's lookups asked the stores for since the last step (each rank counts
    # them, beside the units it loads, in what the node daemon shows as lookups and hits).
    lookup_units: int = 0


@dataclass
class TuttiWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: keys that became present or absent in the stores, and
    per request the first unit that failed to load (vLLM recomputes it; the scheduler saves it again)."""

    committed: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)
    inner: dict[int, list[int]] = field(default_factory=dict)  # committed unit key -> its inner keys

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TuttiWorkerMetadata)
        failed = dict(self.failed)
        for req_id, unit in other.failed.items():
            failed[req_id] = min(unit, failed.get(req_id, unit))
        return TuttiWorkerMetadata(self.committed + other.committed, self.evicted + other.evicted, failed,
                                   {**self.inner, **other.inner})


@dataclass
class TuttiHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at start: the keys its store found on disk, and its units' inner
    keys (inner key -> unit key)."""

    rank: int
    keys: list[int]
    inner: dict[int, int] = field(default_factory=dict)
    # Why the worker's store did not open, when it serves without the cache (on_store_error).
    store_error: str | None = None

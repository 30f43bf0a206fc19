"""The scheduler side of the connector (engine-core process): :class:`TuttiScheduler`.

It never touches storage. ``get_num_new_matched_tokens`` answers from the set of unit keys present
in the workers' stores: that set starts from the keys each worker found on disk when it opened its
share of the file pool (sent once through the connector handshake) and then follows every commit
and eviction the workers report after each step, so a fresh engine sees the units an earlier engine
committed. A unit counts as a hit only when every rank holds it, and at least the last prompt token
is left to compute. With ``etcd`` configured (cluster mode) the hit prefix is extended with the
units other nodes hold, looked up in the replica directory.

Hits are at block granularity: each prompt's last, partial unit (its whole blocks, named by the hash
of its last block like any unit) is saved too, and after the leading whole units a lookup takes the
most blocks one more unit offers: the leading blocks of the next whole unit, the longest partial
unit stored there, or the leading blocks of another prompt's unit that this prompt shares. So a
prompt that repeats, extends or shares a stored prefix recomputes less than one block, not up to
``unit_tokens - 1`` tokens (local units only: the replica directory is asked for whole units).

The last case needs to know where a unit's blocks end: vLLM chains its block hashes, so the hash at
each block boundary inside a unit names the prefix up to there. Each save hands the workers those
hashes, which their stores commit in the unit's header as its *inner keys* (one per rank, like unit
keys). The scheduler learns them like unit keys: from each worker's store at start (handshake),
then from the workers' commit reports (``_InnerIndex``). A lookup that finds its own key at a
boundary inside a stored unit loads that unit's leading blocks, naming it by each rank's key
(``Transfer.tail_keys``).

With ``defer_saves`` a save's writes run on past its step (``TuttiWorker``); a finished request with
such writes keeps its blocks, and stays tracked here with the engine stepping, until the workers
report it in ``finished_sending``.

Each step, ``build_connector_meta`` hands the workers the loads decided since the last step and the
saves of the units whose last prompt token was computed (chunked prefill saves a request's units
over several steps). KV computed on top of a load is saved only once that load is known good: the
units whose last token is computed in a step that loads KV wait until that step's outcome is known,
and units on or after a failed unit or a block vLLM reports invalid are dropped and saved again once
vLLM recomputes them. A request that finishes while such a save is pending keeps its blocks until
the save is done (``request_finished`` returns true; the worker reports it in ``get_finished``).

A failed load leaves wrong KV in blocks that vLLM has already entered in its prefix cache (it caches
a synchronous load's blocks when it schedules it), and with ``kv_load_failure_policy: recompute`` it
keeps them there, trusting the request to recompute them; a request aborted or preempted before
that leaves them to be served to the next prompt that shares them. ``_PoisonedBlocks`` follows
those blocks, and the blocks computed on top of them, until a forward writes them again; a
request that reads one as computed is reported to vLLM as a failed load in that step (its output
is dropped, it recomputes from there), and no save reads one.

A load that starts inside a unit (vLLM's prefix cache holds its leading blocks, which running
requests may read) names those blocks ``SKIP_BLOCK``: the store reads and checks them with the rest
of the unit and writes only the blocks the request allocated, so a failed load never touches KV
that another request reads.

Under vLLM's asynchronous scheduling (``max_concurrent_batches`` > 1) the next step is scheduled and
run before a step's failed loads are known, and vLLM keeps the token that a request it has rewound
computed there. So loads are asynchronous (the request waits outside the batch until its units are
verified).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tutti_cluster.vllm.config import ConnectorSetup, prefix_hash, unit_hashes, unit_key
from tutti_cluster.vllm.metadata import SKIP_BLOCK, Transfer, TuttiConnectorMetadata, TuttiHandshake, TuttiWorkerMetadata
from tutti_cluster.vllm.metrics import TuttiConnectorStats

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("tutti_cluster.vllm")  # one logger for every part of the connector

__all__ = ["TuttiScheduler"]


class _InnerIndex:
    """Inner key -> the key of the unit it lies in (module docs), every rank's, for the
    ``max_units`` unit keys added last (the oldest forgotten first), so that evictions reach it."""

    def __init__(self, max_units: int) -> None:
        self.max_units = max_units
        self._unit_of: dict[int, int] = {}  # inner key -> unit key
        self._units: dict[int, list[int]] = {}  # unit key -> its inner keys, oldest unit first

    def __len__(self) -> int:
        return len(self._units)

    def add(self, unit: int, inner: list[int]) -> None:
        if not inner or unit in self._units:
            return
        self._units[unit] = inner
        for k in inner:
            self._unit_of[k] = unit
        while len(self._units) > self.max_units:
            self.forget(next(iter(self._units)))

    def forget(self, unit: int) -> None:
        for k in self._units.pop(unit, ()):
            if self._unit_of.get(k) == unit:
                del self._unit_of[k]

    def unit_of(self, inner: int) -> int | None:
        return self._unit_of.get(inner)


# A request's part in one step: (its block ids, tokens computed before the step, tokens scheduled).
_Sched = tuple[list[int], int, int]


class _PoisonedBlocks:
    """Blocks of vLLM's KV cache that may hold wrong KV under a prompt's hash in its prefix cache
    (module docs): those of failed loads and those computed on top of them, until a forward (or a
    load) writes them whole again. ``keep_steps`` steps' schedules are kept, for failures reported
    after a later step was scheduled (asynchronous scheduling)."""

    def __init__(self, block_size: int, keep_steps: int) -> None:
        self.block_size = block_size
        self.blocks: set[int] = set()
        self._steps: deque[list[_Sched]] = deque(maxlen=keep_steps)
        self._reported: deque[set[int]] = deque(maxlen=keep_steps)  # each kept step's reported reads

    def _span(self, c: int, n: int) -> tuple[int, int]:
        """Block indices a request writes in a step: from the one holding token ``c`` to the one
        holding token ``c + n - 1``."""
        return c // self.block_size, -(-(c + n) // self.block_size)

    def step(self, sched: list[_Sched], fresh: Iterable[int]) -> set[int]:
        """A step is scheduled: drops the blocks its loads or forward write whole and those ``fresh``
        (loaded, or newly allocated: vLLM dropped their hashes, only their new request reads them,
        and only what it wrote), and returns the poisoned blocks a request reads as computed (fully
        before the step; a block it is part-way through writing is its own). What such a request
        writes is poisoned in turn."""
        self._steps.append(sched)
        if not self.blocks:
            self._reported.append(set())
            return set()
        bs = self.block_size
        fresh = set(fresh)
        tainted: set[int] = set()  # requests that read wrong KV: what they write is wrong too
        while True:  # grows only: a tainted writer leaves more blocks poisoned, tainting more readers
            whole = set(fresh)
            for i, (ids, c, n) in enumerate(sched):
                if i not in tainted:
                    whole.update(ids[c // bs : (c + n) // bs])
            left = self.blocks - whole
            now = {i for i, (ids, c, _) in enumerate(sched) if not left.isdisjoint(ids[: c // bs])}
            if now == tainted:
                break
            tainted = now
        read: set[int] = set()
        for i in tainted:
            ids, c, n = sched[i]
            read |= left.intersection(ids[: c // bs])
            lo, hi = self._span(c, n)
            left.update(ids[lo:hi])
        self.blocks = left
        self._reported.append(read)
        return read

    def failed(self, blocks: Iterable[int]) -> None:
        """Blocks vLLM was told hold no valid KV after a step: poisoned, and with them what the
        kept steps, in order, wrote after reading one of them. The reads this tracker reported
        itself are left out: already followed, and perhaps written whole again since."""
        bad = set(blocks).difference(*self._reported)
        if not bad:
            return
        bs = self.block_size
        for sched in self._steps:
            for ids, c, n in sched:
                if not bad.isdisjoint(ids[: -(-c // bs)]):  # read as computed (its own partial block too)
                    lo, hi = self._span(c, n)
                    bad.update(ids[lo:hi])
        self.blocks |= bad


# (local units, all units, tail tokens, tail unit's hash, tail unit's key per rank): TuttiScheduler._lookup
_Lookup = tuple[int, int, int, "bytes | None", "list[int] | None"]


@dataclass
class _ReqState:
    request: Any
    save_next: int = 0  # first unit not yet claimed for a save (or known present)
    block_ids: list[int] = field(default_factory=list)
    pending: set[int] = field(default_factory=set)  # claimed units whose save waits (see build_connector_meta)
    due: int = 0  # the step from which the pending units may be saved
    finished: bool = False  # finished, blocks held until the pending save is done
    writing: bool = False  # a save was handed to the workers, whose writes may still run (defer_saves)
    finish_sent: bool = False  # finished; told the workers, who report it once its writes are done


class TuttiScheduler:
    """The connector's scheduler role: lookups, load decisions and save scheduling (module docs)."""

    def __init__(self, setup: ConnectorSetup, vllm_config: VllmConfig) -> None:
        self.setup = setup
        self.options = setup.options
        self.unit_tokens = setup.unit_tokens
        self.unit_blocks = setup.unit_blocks
        self._prefixes = setup.prefixes
        kv_transfer_config = vllm_config.kv_transfer_config
        if self.options.load and getattr(kv_transfer_config, "kv_load_failure_policy", None) == "fail":
            log.warning(
                "Tutti connector: kv_load_failure_policy is 'fail' (vLLM's default), so a unit that fails to "
                "load (evicted since the lookup, a missing file, a checksum mismatch) fails the request that "
                "needed it instead of being recomputed; set \"kv_load_failure_policy\": \"recompute\" in "
                "--kv-transfer-config (docs/VLLM.md)")
        self._stats = TuttiConnectorStats()
        self._present: set[int] = set()
        # The inner keys of 32,768 units per rank at most (8.4M prompt tokens at 256-token units;
        # about 1.4 KB per unit of 16 blocks, 47 MB per rank when full).
        self._inner = _InnerIndex(max_units=(1 << 15) * setup.world)
        self._reqs: dict[str, _ReqState] = {}
        self._lookups: dict[str, _Lookup] = {}  # req_id -> the latest _lookup
        self._pending_loads: list[Transfer] = []
        self._pending_async: list[Transfer] = []
        self._lookups_at: dict[str, tuple[float, int, int, int]] = {}  # req_id -> (time, units asked, local, all)
        # Units each request's latest lookup asked for beyond vLLM's own prefix cache, and those of
        # the requests allocated since the last step (sent to the workers: the node daemon's lookups).
        self._asked: dict[str, int] = {}
        self._asked_units = 0
        self.store_error: str | None = None  # a worker's store did not open: serving without the cache
        self._step = 0
        self._last_load_step = -(1 << 30)
        # Steps whose outcome may still be unknown when the next one is scheduled (async scheduling,
        # pipeline parallelism): a load failure there is reported that many steps later.
        self._defer = max(1, int(getattr(vllm_config, "max_concurrent_batches", 1) or 1))
        self._poisoned = _PoisonedBlocks(setup.block_size, keep_steps=self._defer)
        # Under asynchronous scheduling (vLLM's default on GPUs) the next step is scheduled, and
        # runs, before a step's output is processed: a request whose load failed would compute its
        # next token over the failed blocks, and vLLM, which has rewound the request by then,
        # keeps that token. So loads go through vLLM's asynchronous path (the request joins a
        # later step, once its load is known good).
        self._load_async = self.options.load_async or self._defer > 1
        if self._load_async and not self.options.load_async and self.options.load:
            log.info("Tutti connector: vLLM schedules asynchronously, so loads are asynchronous "
                     "(a request joins the batch once its units are loaded and verified)")
        self._directory: Any = None
        config = setup.config
        if self.options.load and config.etcd:
            # Cluster mode: units past the local hit prefix are looked up in the replica directory.
            from tutti_cluster.cluster.directory import EtcdDirectory
            from tutti_cluster.cluster.etcd import EtcdSecurity

            node_id = config.node_id or socket.gethostname()
            from tutti_cluster.cluster.auth import cluster_secret

            self._directory = EtcdDirectory(",".join(config.etcd), node_id, config.lease_ttl_s,
                                            security=EtcdSecurity.from_config(config), secret=cluster_secret(config))

    def take_stats(self) -> TuttiConnectorStats | None:
        return self._stats.take()

    def shutdown(self) -> None:
        """Closes the replica directory's etcd connection (lookups only: it holds no lease)."""
        if self._directory is not None:
            self._directory.stop(revoke=False)
            self._directory = None

    # ---- what the workers' stores hold ----------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        errors = [m.store_error for m in metadata.values() if isinstance(m, TuttiHandshake) and m.store_error]
        if errors:
            # A worker serves without its store (on_store_error: serve_without_cache): a unit is a
            # hit only on every rank, so no lookup hits and nothing is saved until the engine restarts.
            self.store_error = errors[0]
            self.options = dataclasses.replace(self.options, load=False, save=False)
            log.warning("Tutti connector: no prefix is looked up or saved: a worker's store could not open (%s)",
                        errors[0])
            return
        for m in metadata.values():
            if isinstance(m, TuttiHandshake):
                self._present.update(m.keys)
                units: dict[int, list[int]] = {}
                for inner, unit in m.inner.items():
                    units.setdefault(unit, []).append(inner)
                for unit, inners in units.items():
                    self._inner.add(unit, inners)
        log.info("Tutti connector: %d units present in the workers' stores (%d inner keys)", len(self._present),
                 len(self._inner))

    def _hits(self, hashes: list[bytes]) -> int:
        """Leading units present on every rank."""
        n = len(hashes)
        for prefix in self._prefixes:
            i = 0
            while i < n and unit_key(prefix, hashes[i]) in self._present:
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
            owners = self._directory.lookup([unit_key(prefix, h) for h in hashes[local : local + n]],
                                            prefix=True, exclude_self=False)
            n = min(n, len(owners))
        return n

    def _lookup(self, request: Request) -> _Lookup:
        """(local, total, tail, tail hash, tail keys): the leading whole units of the request's prompt
        available to load from this node and from the cluster, then the tokens available after them
        from one more unit (when all of them are local; else 0), and what names that unit: its hash,
        or, for a unit found by its inner keys on disk, each rank's key of it (see ``_tail_hit``).

        A directory lookup costs an etcd round trip, and vLLM asks again for a request it could not
        schedule yet, so a cluster answer is reused for a second.
        """
        max_tokens = max(request.num_tokens - 1, 0)
        hashes = self._hashes(request, max_tokens // self.unit_tokens)
        local = total = self._hits(hashes)
        if self._directory is not None and local < len(hashes):
            now = time.monotonic()
            cached = self._lookups_at.get(request.request_id)
            if cached is not None and now - cached[0] < 1.0 and cached[1:3] == (len(hashes), local):
                total = cached[3]
            else:
                total = local + self._remote_hits(hashes, local)
                self._lookups_at[request.request_id] = (now, len(hashes), local, total)
        tail, tail_h, tail_keys = self._tail_hit(request, local, max_tokens) if total == local else (0, None, None)
        return local, total, tail, tail_h, tail_keys

    def _tail_hit(self, request: Request, units: int, max_tokens: int) -> tuple[int, bytes | None, list[int] | None]:
        """(tokens, hash, keys) of the longest run of blocks after the first ``units`` that every
        rank holds in one unit, tried at each block boundary, longest first: the prompt's own unit
        ending there (the next whole unit, of which the last token must be computed, or a partial
        unit), else a unit that lies across the boundary, found by every rank's inner key there
        (then ``keys`` names it per rank; the hash is the boundary's)."""
        if not self.options.partial_units:
            return 0, None, None
        step, start = self.setup.tail_step, units * self.unit_tokens
        t = min(self.unit_tokens - step, (max_tokens - start) // step * step)
        for end in (start + self.unit_tokens, *range(start + t, start, -step)):
            h = prefix_hash(request.block_hashes, self.setup.hash_block, end) if t > 0 else None
            if h is None:
                continue
            if all(unit_key(p, h) in self._present for p in self._prefixes):  # this prompt's own unit
                return min(t, end - start), h, None
            keys = [self._inner.unit_of(unit_key(p, h)) for p in self._prefixes]  # one sharing its blocks
            if all(k is not None and k in self._present for k in keys):
                return min(t, end - start), h, keys  # type: ignore[return-value]
        return 0, None, None

    def _boundaries(self, request: Request, unit: int, tokens: int) -> list[bytes]:
        """The hashes at the block boundaries inside unit ``unit`` of ``request`` (``tokens`` long)."""
        step, start = self.setup.tail_step, unit * self.unit_tokens
        return [b for end in range(start + step, start + tokens, step)
                if (b := prefix_hash(request.block_hashes, self.setup.hash_block, end)) is not None]

    def _prompt_tail(self, request: Request) -> tuple[int, int]:
        """(unit index, tokens) of the prompt's partial last unit; tokens 0 when it has none."""
        n = int(request.num_prompt_tokens)
        unit = n // self.unit_tokens
        if not self.options.partial_units:
            return unit, 0
        return unit, (n - unit * self.unit_tokens) // self.setup.tail_step * self.setup.tail_step

    def _hashes(self, request: Request, num_units: int) -> list[bytes]:
        return unit_hashes(list(request.block_hashes), self.setup.unit_hash_blocks, num_units)

    # ---- loads ----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose units (whole, then one partial) the stores hold.

        At least the last prompt token is left to compute. Side-effect free for vLLM; the lookup is
        remembered for ``update_state_after_alloc``.
        """
        if not self.options.load:
            return 0, False
        looked = self._lookup(request)
        self._lookups[request.request_id] = looked
        self._asked[request.request_id] = self._units_asked(request, num_computed_tokens)
        _, hits, tail, _, _ = looked
        ext = hits * self.unit_tokens + tail - num_computed_tokens
        if ext <= 0:
            return 0, False
        return ext, self._load_async

    def _units_asked(self, request: Request, num_computed_tokens: int) -> int:
        """Units of the prompt a lookup asks the stores for: those a save would store (whole units,
        and with ``partial_units`` the last one's whole blocks; the last prompt token is always
        computed) past the units vLLM's own prefix cache holds whole."""
        last = int(request.num_prompt_tokens) - 1
        if self.options.partial_units:
            storable = last // self.setup.tail_step * self.setup.tail_step
            total = -(-storable // self.unit_tokens)
        else:
            total = last // self.unit_tokens
        return max(0, total - num_computed_tokens // self.unit_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        self._asked_units += self._asked.pop(req_id, 0)
        looked = self._lookups.pop(req_id, None)
        local, hits, tail, tail_h, tail_keys = looked if looked is not None else self._lookup(request)
        state = self._reqs.get(req_id)
        if state is None or num_external_tokens > 0:
            state = _ReqState(request=request, save_next=hits)
            self._reqs[req_id] = state
        else:
            state.request = request
        if num_external_tokens <= 0:
            return
        end = hits * self.unit_tokens + tail
        first = (end - num_external_tokens) // self.unit_tokens
        (block_ids,) = blocks.get_block_ids()[:1]
        hashes = self._hashes(request, hits)[first:hits]
        want = len(hashes) * self.unit_blocks
        if tail and tail_h is not None:  # last: only a request's last unit may move fewer blocks
            hashes.append(tail_h)
            want += tail // self.setup.block_size
            if tail_keys:  # another prompt's unit, sharing only these blocks
                self._stats.add("lookup_shared_units", 1)
        ids = list(block_ids[first * self.unit_blocks : first * self.unit_blocks + want])
        if len(ids) != want:
            log.warning("request %s: %d blocks allocated for %d units; not loading", req_id, len(ids), len(hashes))
            return
        # A load starting inside a unit: vLLM's prefix cache holds the unit's leading blocks, which
        # running requests may read. The store checks them with the unit and leaves them as they are.
        held = (end - num_external_tokens - first * self.unit_tokens) // self.setup.block_size
        ids[:held] = [SKIP_BLOCK] * held
        self._stats.add("lookup_hit_units", len(hashes))
        remote_from = max(local - first, 0) if hits > local else None
        t = Transfer(req_id, hashes, ids, first, remote_from, tail_keys=tail_keys)
        (self._pending_async if self._load_async else self._pending_loads).append(t)

    # ---- each step ------------------------------------------------------------------------------
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

    def _fresh_blocks(self, scheduler_output: SchedulerOutput, meta: TuttiConnectorMetadata,
                      computed: dict[str, int]) -> Iterable[int]:
        """The blocks this step loads or newly allocates (those past a new or resumed request's
        computed tokens, and a running request's new ones); read only while a block is poisoned."""
        for t in meta.loads + meta.async_loads:
            yield from t.written()
        bs = self.setup.block_size
        for new in scheduler_output.scheduled_new_reqs:
            yield from new.block_ids[0][computed[new.req_id] // bs :]
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if ids is not None:
                yield from ids[0][computed[req_id] // bs :] if req_id in resumed else ids[0]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TuttiConnectorMetadata:
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
        meta = TuttiConnectorMetadata(loads=self._pending_loads, async_loads=self._pending_async,
                                      preempted=list(getattr(scheduler_output, "preempted_req_ids", None) or ()),
                                      lookup_units=self._asked_units)
        self._pending_loads, self._pending_async = [], []
        self._asked_units = 0
        computed: dict[str, int] = {n.req_id: n.num_computed_tokens for n in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
        sched = [(st.block_ids, computed[r], n) for r, n in scheduler_output.num_scheduled_tokens.items()
                 if (st := self._reqs.get(r)) is not None and r in computed]
        read = self._poisoned.step(sched, self._fresh_blocks(scheduler_output, meta, computed))
        if read:
            log.warning("Tutti: %d blocks of a failed load are in vLLM's prefix cache and were read by a "
                        "request; reported as failed, vLLM recomputes them", len(read))
            meta.invalid_blocks = sorted(read)
            self._stats.add("poisoned_block_reads", len(read))
        if meta.loads:
            self._last_load_step = step
        if not self.options.save:
            return meta
        risky = step - self._last_load_step < self._defer
        seen: set[bytes] = set()
        # Saves that waited for their step's outcome.
        for req_id, st in list(self._reqs.items()):
            if (st.pending or (st.finished and not st.finish_sent)) and st.due <= step:
                units = sorted(st.pending)
                st.pending.clear()
                self._emit(meta, req_id, st, units, seen)
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or req_id not in computed:
                continue
            done = min(computed[req_id] + n_sched, st.request.num_prompt_tokens)
            end_unit = min(done // self.unit_tokens, len(st.block_ids) // self.unit_blocks,
                           len(st.request.block_hashes) // self.setup.unit_hash_blocks)
            tail_unit, tail = self._prompt_tail(st.request)
            if tail and end_unit == tail_unit and done >= tail_unit * self.unit_tokens + tail:
                end_unit += 1  # the prompt's partial last unit: its whole blocks are computed
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

    def _span(self, st: _ReqState, unit: int) -> tuple[bytes, list[int]] | None:
        """(hash, block ids) of unit ``unit`` of a request's prompt: whole, or the prompt's partial
        last unit; None while its hash or blocks are not known yet."""
        tail_unit, tail = self._prompt_tail(st.request)
        tokens = tail if unit == tail_unit and tail else self.unit_tokens
        h = prefix_hash(st.request.block_hashes, self.setup.hash_block, unit * self.unit_tokens + tokens)
        lo = unit * self.unit_blocks
        hi = lo + tokens // self.setup.block_size
        if h is None or len(st.block_ids) < hi:
            return None
        return h, st.block_ids[lo:hi]

    def _emit(self, meta: TuttiConnectorMetadata, req_id: str, st: _ReqState, units: list[int],
              seen: set[bytes]) -> None:
        """Adds a save of ``units`` of a request (those not yet present) to this step's metadata.
        A partial unit can only be the prompt's last, so it is the transfer's last too."""
        hashes: list[bytes] = []
        ids: list[int] = []
        inner: list[list[bytes]] = []
        for u in units:
            span = self._span(st, u)
            if span is not None and not self._poisoned.blocks.isdisjoint(span[1]):
                st.save_next = min(st.save_next, u)  # computed on wrong KV: saved once recomputed
                break
            if span is None or span[0] in seen or all(unit_key(p, span[0]) in self._present for p in self._prefixes):
                continue
            seen.add(span[0])
            hashes.append(span[0])
            ids.extend(span[1])
            if self.options.partial_units:
                inner.append(self._boundaries(st.request, u, len(span[1]) * self.setup.block_size))
        if hashes or st.finished:
            meta.saves.append(Transfer(req_id, hashes, ids, finish=st.finished, inner=inner or None))
        st.writing = st.writing or (bool(hashes) and self.options.defer_saves)
        if st.finished:
            # Kept (and the engine stepping) until the workers report it, once its writes are done:
            # an idle engine would otherwise stop before they commit.
            st.finish_sent = True
            if not st.writing:
                del self._reqs[req_id]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in getattr(connector_output, "finished_sending", None) or ():
            st = self._reqs.get(req_id)
            if st is not None and st.finished:
                del self._reqs[req_id]
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, TuttiWorkerMetadata):
            self._present.update(meta.committed)
            self._present.difference_update(meta.evicted)
            for unit, inner in meta.inner.items():
                self._inner.add(unit, inner)
            for key in meta.evicted:
                self._inner.forget(key)
            for req_id, unit in meta.failed.items():
                self._unclaim(req_id, unit)
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self._poisoned.failed(invalid)
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

    # ---- finished requests ----------------------------------------------------------------------
    def has_pending_push_work(self) -> bool:
        # A finished request's pending save or running writes hold its blocks: keep the engine
        # stepping until they are done (and their units committed).
        return any(st.finished for st in self._reqs.values())

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Frees the blocks at once unless a save still has to read them (one deferred until a
        load is known good, or writes running on past their step); then the workers report the
        request (``get_finished``) once that is done."""
        self._lookups.pop(request.request_id, None)
        self._lookups_at.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        st = self._reqs.get(request.request_id)
        if st is not None and (st.pending or st.writing):
            st.finished = True
            return True, None
        self._reqs.pop(request.request_id, None)
        return False, None

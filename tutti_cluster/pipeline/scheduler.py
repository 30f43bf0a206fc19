"""The slack-aware I/O scheduler: a request's prefix reads and its new KV's writes, placed in the
idle windows of the layers' compute.

A *slack window* is the time one layer's compute takes with the I/O partition's SMs running
(from the offline profile, :class:`~tutti_cluster.pipeline.table.SlackTable`, or measured per layer on the
resident run). Reads are on the critical path; writes only ever fill what reads leave free.

Per layer ``l`` (``before_layer``):

1. Reads of layer ``l`` not yet issued are needed now: they go at once, whatever they cost.
2. Then (``before_attention``, once layer ``l``'s reads have landed, so that they had the device to
   themselves) reads of the next layers, in order, one IOCB at a time, while their estimated time
   fits what is left of window ``l`` (and, with ``read_ahead``, up to layer ``l + read_ahead``).
   When not even one fits a whole window, retrieval is the bottleneck: every read still needed
   goes then (as a plain pipeline would issue them).
3. Only when no read is left waiting for a later window (the read queue is empty, or its next IOCB
   did not fit) and the window still has room: writes of layers whose KV is final (``< l``), one
   layer at a time, while a layer's estimated write time fits the rest of the window. A window
   holds reads *or* writes up to its length, never both at full rate: their estimated times are
   summed against one budget, and the I/O kernel serves IOCBs in the order they were launched.

Reads, ``reads="iocb"``: the raw gio_uring API (``get_iocb``, ``fill_iocb``, ``issue_io``,
``wait_cqe``, ``put_iocb``): a layer's IOCTXs are cut into IOCBs of ``iocb_ioctx`` so that a window
takes part of a layer. ``before_attention(l)`` waits for layer ``l``'s IOCBs (``wait_cqe``, which
blocks the host) and puts them back; a failed IOCTX makes the restore failed (``failed_iocbs``).
The store's ``finish`` counts only layers issued with ``retrieve_layer``, so the caller judges such
a request by ``failed_iocbs``, not by ``finish``.

Reads, ``reads="layer"``: whole layers through ``retrieve_layer``/``wait_layer``. On CUDA these are
stream-ordered: a read issued at ``before_layer(l)`` starts when the GPU reaches layer ``l`` (the
event the store records on the caller's stream), which is where window ``l`` begins in GPU time,
one issued at ``before_attention(l)`` when layer ``l``'s reads have landed (the wait is on that
stream before it), and the wait holds only the compute stream. The raw IOCBs' ``wait_cqe`` holds
the host instead, which, on a GPU, also stops the host from queueing the next layers' kernels.

Writes go through the store request (``store_layer``), whose ``finish`` commits the units whose
every layer was written; on CUDA a write issued at ``before_attention(l)`` starts in window ``l`` in
GPU time, after layer ``l``'s reads and the kernels that wrote its KV.

Writes left at the end of prefill are flushed during decode (``decode_step``: at most what fits
one decode step's window per step) and, best effort, at ``flush``: every layer not yet written is
written then, and ``finish`` reports each unit committed or not stored. Nothing is dropped.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tutti_cluster.errors import ConfigError, TuttiError
from tutti_cluster.pipeline.hooks import LayerHooks

if TYPE_CHECKING:
    from tutti_cluster.store import UnitFailure

log = logging.getLogger(__name__)

MAX_IOCTX_PER_IOCB = 2048


@dataclass
class _ReadIocb:
    layer: int
    first: int
    count: int
    seconds: float  # estimated
    iocb: int = -1


@dataclass
class ScheduleReport:
    """What the scheduler did for one request."""

    read_iocbs: int = 0
    reads_issued_at_once: int = 0  # IOCBs issued because their layer needed them now
    failed_iocbs: int = 0
    writes_in_prefill: list[int] = field(default_factory=list)  # layers written during prefill
    writes_in_decode: list[int] = field(default_factory=list)
    writes_flushed: list[int] = field(default_factory=list)  # layers written at flush (after decode)
    committed_units: list[int] = field(default_factory=list)
    skipped_units: int = 0  # stored already (by an earlier request): nothing to write
    not_stored_units: list[int] = field(default_factory=list)  # reported, never silently dropped
    failures: list[UnitFailure] = field(default_factory=list)  # why each was not stored, and where
    store_units: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "read_iocbs": self.read_iocbs, "reads_issued_at_once": self.reads_issued_at_once,
            "failed_iocbs": self.failed_iocbs, "writes_in_prefill": len(self.writes_in_prefill),
            "writes_in_decode": len(self.writes_in_decode), "writes_flushed": len(self.writes_flushed),
            "store_units": self.store_units, "committed_units": len(self.committed_units),
            "skipped_units": self.skipped_units, "not_stored_units": len(self.not_stored_units),
        }


class SlackScheduler(LayerHooks):
    """Schedules one request's reads (raw IOCBs of retrieve request ``read_req``) and writes (layers
    of store request ``write_req``) into the given per-layer slack windows (seconds).

    ``read_seconds_per_ioctx`` and ``write_seconds_per_layer`` are the estimated costs (from the
    measured bandwidths); ``decode_window`` is the slack of one decode step. ``read_ahead`` (0: no
    limit) bounds how many layers ahead of the compute a window's reads may reach.
    """

    def __init__(self, store: Any, *, layers: int, windows: Sequence[float], read_req: int | None, read_ioctx: int,
                 read_seconds_per_ioctx: float, write_req: int | None = None, write_seconds_per_layer: float = 0.0,
                 decode_window: float = 0.0, iocb_ioctx: int = 1024, sms: int = 0, reads: str = "iocb",
                 read_ahead: int = 0) -> None:
        if reads not in ("iocb", "layer"):
            raise ConfigError(f"reads must be 'iocb' or 'layer', not {reads!r}")
        if read_ahead < 0:
            raise ConfigError("read_ahead must be 0 (as far as the windows hold) or positive")
        if len(windows) != layers:
            raise ConfigError(f"{len(windows)} slack windows for {layers} layers")
        if not 0 < iocb_ioctx <= MAX_IOCTX_PER_IOCB:
            raise ConfigError(f"iocb_ioctx must be in [1, {MAX_IOCTX_PER_IOCB}], not {iocb_ioctx}")
        if read_req is not None and read_ioctx <= 0:
            raise ConfigError("a read request needs at least one IOCTX per layer")
        if min(windows, default=0.0) < 0 or read_seconds_per_ioctx < 0 or write_seconds_per_layer < 0:
            raise ConfigError("windows and cost estimates must be non-negative")
        self.store = store
        self.layers = layers
        self.windows = list(windows)
        self.read_req = read_req
        self.write_req = write_req
        self.sms = sms
        self.reads = reads
        self.read_ahead = read_ahead
        self.write_cost = write_seconds_per_layer
        self.decode_window = decode_window
        self.report = ScheduleReport()
        self._queue: deque[_ReadIocb] = deque()
        self._issued: dict[int, list[_ReadIocb]] = {}
        self._window: tuple[list[_ReadIocb], float] = ([], 0.0)  # reads and budget left for before_attention
        if read_req is not None:
            piece = read_ioctx if reads == "layer" else iocb_ioctx
            for layer in range(layers):
                for first in range(0, read_ioctx, piece):
                    count = min(piece, read_ioctx - first)
                    self._queue.append(_ReadIocb(layer, first, count, count * read_seconds_per_ioctx))
        self._writes: deque[int] = deque()  # layers whose KV is final and not yet written
        self._written: set[int] = set()
        self._finished = False

    # ---- reads -----------------------------------------------------------------------------------
    def _issue(self, batch: list[_ReadIocb]) -> None:
        if not batch:
            return
        if self.reads == "layer":
            for r in batch:
                self.store.retrieve_layer(r.layer, self.read_req)
                self._issued.setdefault(r.layer, []).append(r)
            self.report.read_iocbs += len(batch)
            return
        ids = self.store.get_iocb(len(batch))
        try:
            for r, iocb in zip(batch, ids):
                self.store.fill_iocb(iocb, op="read", layer=r.layer, req=self.read_req, first=r.first, count=r.count)
                r.iocb = iocb
            self.store.issue_io(ids, self.sms)
        except TuttiError:
            for iocb in ids:
                self.store.put_iocb(iocb)
            raise
        for r in batch:
            self._issued.setdefault(r.layer, []).append(r)
        self.report.read_iocbs += len(batch)

    def before_layer(self, layer: int) -> None:
        budget = self.windows[layer]
        now: list[_ReadIocb] = []
        while self._queue and self._queue[0].layer <= layer:
            now.append(self._queue.popleft())
        ahead: list[_ReadIocb] = []
        last = layer + self.read_ahead if self.read_ahead else self.layers
        while self._queue and self._queue[0].seconds <= budget and self._queue[0].layer <= last:
            r = self._queue.popleft()
            budget -= r.seconds
            ahead.append(r)
        if not ahead and self._queue and self._queue[0].seconds > self.windows[layer]:
            # No slack window holds even one IOCB: retrieval is the bottleneck, so every read
            # still needed goes with this window, for the most overlap the device can give.
            ahead = list(self._queue)
            self._queue.clear()
            budget = 0.0
            self.report.reads_issued_at_once += len(ahead)
        self.report.reads_issued_at_once += len(now)
        # The layer's own reads go alone; what fills its window follows once they have landed
        # (before_attention), so that the critical reads do not share the device with it.
        self._issue(now)
        self._window = (ahead, budget)

    def before_attention(self, layer: int) -> None:
        self._wait_reads(layer)
        ahead, budget = self._window
        self._window = ([], 0.0)
        self._issue(ahead)
        # Writes only where no read waits for this window.
        if self.write_req is not None and (not self._queue or self._queue[0].seconds > budget):
            while self._writes and self.write_cost <= budget:
                l = self._writes.popleft()
                self._write(l)
                budget -= self.write_cost
                self.report.writes_in_prefill.append(l)

    def _wait_reads(self, layer: int) -> None:
        if self.reads == "layer":
            if self._issued.pop(layer, None):
                self.store.wait_layer(layer, self.read_req)
            return
        for r in self._issued.pop(layer, []):
            failed = self.store.wait_cqe(r.iocb)
            self.store.put_iocb(r.iocb)
            if failed:
                self.report.failed_iocbs += 1

    # ---- writes ----------------------------------------------------------------------------------
    def after_layer(self, layer: int) -> None:
        if self.write_req is not None:
            self._writes.append(layer)

    def _write(self, layer: int) -> None:
        self.store.store_layer(layer, self.write_req)
        self._written.add(layer)

    def decode_step(self) -> None:
        """Called once per decode step: writes what fits the decode step's window."""
        budget = self.decode_window
        while self.write_req is not None and self._writes and self.write_cost <= budget:
            l = self._writes.popleft()
            self._write(l)
            budget -= self.write_cost
            self.report.writes_in_decode.append(l)

    @property
    def pending_writes(self) -> int:
        return len(self._writes)

    def finish_reads(self) -> None:
        """Waits for and returns every read IOCB still out (a prefill cut short, or an error)."""
        self._window = ([], 0.0)
        for layer in list(self._issued):
            self._wait_reads(layer)
        self._queue.clear()

    def flush(self) -> ScheduleReport:
        """Writes every layer not written yet, finishes the store request and reports each unit
        committed or not stored. Idempotent."""
        self.finish_reads()
        if self.write_req is None or self._finished:
            return self.report
        while self._writes:
            l = self._writes.popleft()
            self._write(l)
            self.report.writes_flushed.append(l)
        res = self.store.finish(self.write_req)
        self._finished = True
        committed = set(res.committed_units)
        self.report.store_units = res.units
        self.report.committed_units = sorted(committed)
        self.report.skipped_units = res.skipped_units
        self.report.not_stored_units = sorted(res.failed_units)
        self.report.failures = list(res.failures)
        if res.failed_units:
            log.warning("write-back: %d of %d units not stored", len(res.failed_units), res.units)
        return self.report

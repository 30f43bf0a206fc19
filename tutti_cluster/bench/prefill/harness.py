"""Prefill with the prefix's KV restored from a :class:`~tutti_cluster.TuttiStore` layer by layer
while the suffix is computed, and the systems it is judged against, each giving a TTFT.

One :class:`Harness` holds the model, the paged KV cache, the store (registered on that cache) and,
for the per-chunk baseline, its files. An :class:`InputCase` is one input of ``n`` tokens: its
token ids, block table (blocks ``0 .. n/block_tokens - 1``) and the keys of its cache units.
:meth:`Harness.prepare` runs the full prefill once (system ``recompute``, timed), which leaves
every token's KV in the cache, and stores the first ``max_prefix`` tokens' units in the store (and
the per-chunk files): that is the prefix a later request finds on storage.

Systems, for a prefix of ``P`` tokens (numbered as in issue 15):

1. ``ideal``: the prefix's KV is already in GPU memory (restored untimed first, so that it holds the
   very bytes the store returns); only the suffix is computed.
2. ``tutti``: the slack-aware scheduler (:mod:`~tutti_cluster.pipeline.scheduler`): raw IOCBs into
   the layers' idle windows, optionally with the suffix's new KV written back (``writeback``).
3. ``naive``: ``begin_retrieve``, then ``retrieve_layer`` for every layer up front (or
   ``naive_ahead`` layers ahead of the compute), ``wait_layer(l)`` before layer ``l``'s attention.
4. ``load-all``: ``retrieve`` of every layer, ``finish``, then the suffix's prefill.
5. ``per-chunk``: the per-chunk baseline's files (LMCache's disk layout), read layer by layer by
   its thread pool, each layer waited for before its attention.
6. ``recompute``: the whole input is computed (no prefix).

Every restoring system starts with the prefix's blocks filled with NaN, and its output (the last
token's hidden state and logits) must equal the ideal run's bit for bit: the same kernels run on the
same bytes. ``recompute`` computes the prefix with other shapes (one prefill of ``n`` tokens
instead of a suffix over a cached prefix), so it is compared within bf16 tolerance only.

On CUDA every system computes on the store's compute stream (the SMs outside the I/O partition)
when the store has one; reads are ordered on that stream (``wait_layer``), with no host
synchronisation except where a system's design has one (``load-all``'s ``finish``, the per-chunk
thread pool, the scheduler's ``wait_cqe``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tutti_cluster.bench.errors import BenchVerificationError
from tutti_cluster.bench.prefill.model import Decoder, PagedKV, PrefillOutput
from tutti_cluster.errors import ConfigError
from tutti_cluster.pipeline.hooks import LayerHooks
from tutti_cluster.pipeline.scheduler import SlackScheduler

log = logging.getLogger(__name__)

SYSTEMS = ("ideal", "tutti", "naive", "load-all", "per-chunk", "recompute")
SYSTEM_NUMBERS = {"ideal": 1, "tutti": 2, "naive": 3, "load-all": 4, "per-chunk": 5, "recompute": 6}
# Largest |difference| of recompute's logits from the ideal's that counts as the same output in bf16
# (the two compute the prefix with different kernel shapes): relative to the logits' scale.
RECOMPUTE_RTOL = 0.05


@dataclass
class InputCase:
    n: int
    tokens: torch.Tensor  # int64, CPU
    block_ids: torch.Tensor  # int64, CPU
    keys: list[int]  # one per unit of the stored prefix
    max_prefix: int
    recompute: dict[str, Any] = field(default_factory=dict)
    write_keys: list[int] = field(default_factory=list)


@dataclass
class Outcome:
    """One timed run of one system."""

    system: str
    ttft_s: float
    out: PrefillOutput
    extra: dict[str, Any] = field(default_factory=dict)


class LayerTimer(LayerHooks):
    """Per-layer compute times of a prefill (CUDA events, or the host clock on the CPU), and the time
    each layer spends at its attention's wait: between this hook's ``before_attention`` and
    :attr:`after_wait`'s (chain them around the hooks that wait, :class:`_Chain`)."""

    def __init__(self, layers: int, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []
        self.waits: list[tuple[Any, Any]] = []  # per layer: before and after the hooks that wait
        self.host_waits: list[tuple[float, float]] = []  # the same on the host clock
        self.layers = layers
        self.after_wait = _AfterWait(self)

    def _now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _gap(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def before_layer(self, layer: int) -> None:
        self.marks.append(self._now())

    def before_attention(self, layer: int) -> None:
        self.waits.append((self._now(), None))
        self.host_waits.append((time.perf_counter(), 0.0))

    def after_layer(self, layer: int) -> None:
        if layer == self.layers - 1:
            self.marks.append(self._now())

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
        return [self._gap(a, b) for a, b in zip(self.marks, self.marks[1:])]

    def parts(self, seconds: list[float] | None = None) -> dict[str, list[float]]:
        """``layer_ms`` (from ``seconds`` when already read), ``pre_wait_ms`` (the kernels before the
        wait: norm, projections, the suffix's KV into the cache), ``wait_ms`` (the wait before the
        attention, on the compute stream on CUDA; the rest of a layer is its attention and MLP) and
        ``host_wait_ms`` (the host in the hooks at the wait: issuing, not waiting, on CUDA)."""
        if seconds is None:
            seconds = self.seconds()  # synchronises: every event below has been reached
        return {"layer_ms": _ms(seconds),
                "pre_wait_ms": _ms([self._gap(m, w[0]) for m, w in zip(self.marks, self.waits)]),
                "wait_ms": _ms([self._gap(a, b) for a, b in self.waits if b is not None]),
                "host_wait_ms": _ms([b - a for a, b in self.host_waits if b])}


def _ms(seconds: list[float]) -> list[float]:
    return [round(x * 1e3, 3) for x in seconds]


class _AfterWait(LayerHooks):
    def __init__(self, timer: LayerTimer) -> None:
        self.timer = timer

    def before_attention(self, layer: int) -> None:
        t = self.timer
        if t.waits and t.waits[-1][1] is None:
            t.waits[-1] = (t.waits[-1][0], t._now())
            t.host_waits[-1] = (t.host_waits[-1][0], time.perf_counter())


class _Chain(LayerHooks):
    def __init__(self, *hooks: LayerHooks) -> None:
        self.hooks = hooks

    def before_layer(self, layer: int) -> None:
        for h in self.hooks:
            h.before_layer(layer)

    def before_attention(self, layer: int) -> None:
        for h in self.hooks:
            h.before_attention(layer)

    def after_layer(self, layer: int) -> None:
        for h in self.hooks:
            h.after_layer(layer)


class _NaiveHooks(LayerHooks):
    """retrieve_layer for every layer at the start (``ahead`` = 0) or ``ahead`` layers ahead."""

    def __init__(self, store: Any, req: int, layers: int, ahead: int) -> None:
        self.store, self.req, self.layers = store, req, layers
        self.ahead = layers if ahead <= 0 else ahead
        self.next = 0

    def before_layer(self, layer: int) -> None:
        while self.next < min(self.layers, layer + 1 + self.ahead):
            self.store.retrieve_layer(self.next, self.req)
            self.next += 1

    def before_attention(self, layer: int) -> None:
        self.store.wait_layer(layer, self.req)


class _CpuMeter(LayerHooks):
    """The host thread's CPU time in another hook's calls (the scheduler's issues and waits)."""

    def __init__(self, inner: LayerHooks) -> None:
        self.inner = inner
        self.ns = 0

    def _measure(self, fn: Callable[[int], None], layer: int) -> None:
        t0 = time.thread_time_ns()
        fn(layer)
        self.ns += time.thread_time_ns() - t0

    def before_layer(self, layer: int) -> None:
        self._measure(self.inner.before_layer, layer)

    def before_attention(self, layer: int) -> None:
        self._measure(self.inner.before_attention, layer)

    def after_layer(self, layer: int) -> None:
        self._measure(self.inner.after_layer, layer)


class _PerChunkHooks(LayerHooks):
    def __init__(self, reader: Any, ahead: int, layers: int) -> None:
        self.reader, self.layers = reader, layers
        self.ahead = layers if ahead <= 0 else ahead
        self.next = 0

    def before_layer(self, layer: int) -> None:
        while self.next < min(self.layers, layer + 1 + self.ahead):
            self.reader.retrieve_layer(self.next)
            self.next += 1

    def before_attention(self, layer: int) -> None:
        self.reader.wait_layer(layer)


def compare(a: PrefillOutput, b: PrefillOutput) -> dict[str, Any]:
    """Bitwise equality and the largest differences of two prefills' outputs."""
    exact = torch.equal(a.hidden, b.hidden) and torch.equal(a.logits, b.logits)
    diff = (a.logits - b.logits).abs()
    finite = bool(torch.isfinite(b.logits).all())
    return {"exact": bool(exact), "finite": finite,
            "max_abs_diff": float(diff.max()) if finite else math.inf,
            "logit_scale": float(a.logits.abs().max())}


class Harness:
    """Runs the systems of one model, cache and store; see the module docstring."""

    def __init__(self, model: Decoder, kv: PagedKV, store: Any, *, per_chunk: Any = None, naive_ahead: int = 0,
                 iocb_ioctx: int = 1024, compute_stream: bool = True, seed: int = 0, tutti_reads: str = "auto",
                 read_ahead: int = 0, barrier: Callable[[], None] | None = None) -> None:
        if tutti_reads not in ("auto", "iocb", "layer"):
            raise ConfigError(f"tutti_reads must be auto, iocb or layer, not {tutti_reads!r}")
        if naive_ahead < 0 or read_ahead < 0:
            raise ConfigError("naive_ahead and read_ahead must be 0 (no limit) or positive")
        self.model = model
        self.kv = kv
        self.store = store
        self.per_chunk = per_chunk
        self.naive_ahead = naive_ahead
        self.read_ahead = read_ahead
        self.iocb_ioctx = iocb_ioctx
        # Tensor parallelism: every rank's timed work starts together (each rank's time then ends
        # with the group's last collective; the bench takes the slowest rank's).
        self.barrier = barrier
        self.cuda = kv.device.type == "cuda"
        # Stream-ordered whole layers on a GPU (raw IOCBs' wait_cqe would hold the host there).
        self.tutti_reads = ("layer" if self.cuda else "iocb") if tutti_reads == "auto" else tutti_reads
        self.unit_tokens = int(store.unit_tokens)
        self.bt = model.shape.block_tokens
        self.objs_per_layer = len(store.layers[0].ptrs)
        self._rng = np.random.default_rng(seed ^ 0x9E37)
        self._stream: Any = None
        if self.cuda and compute_stream:
            h = store.compute_stream()
            if h:
                self._stream = torch.cuda.ExternalStream(h)
        self.read_bps = 0.0  # measured: restores of the prefix
        self.write_bps = 0.0  # measured: the prefix's store
        self.layer_seconds: dict[tuple[int, int], list[float]] = {}  # (n, P) -> per-layer compute
        self.itl_s: dict[int, float] = {}  # input -> decode step with no I/O
        self.windows: Callable[[int, int], list[float] | None] | None = None  # an offline profile

    # ---- helpers -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
        else:
            with torch.cuda.stream(self._stream):
                yield

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _start(self) -> None:
        if self.barrier is not None:
            self.barrier()

    def _timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        self._sync()
        self._start()
        t0 = time.perf_counter()
        with self._on_stream():
            out = fn()
        self._sync()
        return out, time.perf_counter() - t0

    def _timed_step(self, fn: Callable[[], Any]) -> float:
        """Seconds of ``fn``'s work on the compute stream alone: I/O it starts on other streams runs on
        past the step (an engine waits for its token, not for the writes), beside the next steps."""
        with self._on_stream():
            stream = torch.cuda.current_stream() if self.cuda else None
            if stream is not None:
                stream.synchronize()
            self._start()
            t0 = time.perf_counter()
            fn()
            if stream is not None:
                stream.synchronize()
            return time.perf_counter() - t0

    def _prefix_blocks(self, case: InputCase, prefix: int) -> torch.Tensor:
        return case.block_ids[: prefix // self.bt]

    def _prefix_keys(self, case: InputCase, prefix: int) -> list[int]:
        return case.keys[: prefix // self.unit_tokens]

    def check_prefix(self, case: InputCase, prefix: int) -> None:
        if not 0 < prefix < case.n or prefix % self.unit_tokens:
            raise ConfigError(f"prefix of {prefix} tokens: must be a multiple of unit_tokens={self.unit_tokens} "
                              f"in (0, {case.n}) for an input of {case.n} tokens")
        if prefix > case.max_prefix:
            raise ConfigError(f"prefix of {prefix} tokens exceeds the {case.max_prefix} stored for this input")

    def new_case(self, n: int, max_prefix: int) -> InputCase:
        """An input of ``n`` tokens whose first ``max_prefix`` tokens will be stored."""
        if n <= 0 or n % self.unit_tokens:
            raise ConfigError(f"input of {n} tokens: must be a positive multiple of unit_tokens={self.unit_tokens}")
        if n // self.bt > self.kv.max_blocks:
            raise ConfigError(f"input of {n} tokens needs {n // self.bt} blocks; the KV cache has {self.kv.max_blocks}")
        if not 0 < max_prefix < n or max_prefix % self.unit_tokens:
            raise ConfigError(f"stored prefix of {max_prefix} tokens must be a multiple of {self.unit_tokens} below {n}")
        tokens = torch.from_numpy(self._rng.integers(0, self.model.shape.vocab, size=n, dtype=np.int64))
        keys = [int(k) for k in self._rng.integers(1, 2**63 - 1, size=max_prefix // self.unit_tokens)]
        return InputCase(n, tokens, torch.arange(n // self.bt, dtype=torch.int64), keys, max_prefix)

    # ---- setup -------------------------------------------------------------------------------------
    def prepare(self, case: InputCase, compute: bool = True) -> Outcome | None:
        """Full prefill (timed: system 6), then the prefix's units to the store and per-chunk files.

        ``compute=False`` puts seeded random KV into the prefix's blocks instead of computing it
        (every system still sees the same bytes; returns None): for inputs too long to recompute."""
        rec = None
        ids = self._prefix_blocks(case, case.max_prefix)
        if compute:
            out, t = self._timed(lambda: self.model.prefill(self.kv, case.tokens, 0, case.block_ids))
            rec = Outcome("recompute", t, out)
            case.recompute = {"ttft_s": t}
        else:
            self.kv.randomize(ids, int(self._rng.integers(1 << 62)))
        res, t_store = self._timed(lambda: self.store.store(case.keys, ids.tolist()))
        if res.failed_units or len(res.committed_units) + res.skipped_units != len(case.keys):
            raise BenchVerificationError(f"storing the prefix: {len(res.failed_units)} of {len(case.keys)} units failed")
        self.write_bps = self._layer_bytes(len(case.keys)) * self.model.shape.layers / t_store
        if self.per_chunk is not None:
            self.per_chunk.store_prefix(ids)
        self._sync()
        return rec

    def _layer_bytes(self, units: int) -> int:
        layer = self.store.layers[0]
        return units * self.store.unit_blocks * layer.block_bytes * len(layer.ptrs)

    def release(self, case: InputCase) -> None:
        """Removes the case's units from the store and the per-chunk files."""
        for k in case.keys + case.write_keys:
            self.store.remove(k)
        if self.per_chunk is not None:
            self.per_chunk.remove_files()

    def restore(self, case: InputCase, prefix: int) -> float:
        """Untimed for the systems: puts the stored prefix into its blocks; returns the seconds taken."""
        ids = self._prefix_blocks(case, prefix)
        keys = self._prefix_keys(case, prefix)
        res, t = self._timed(lambda: self.store.retrieve(keys, ids.tolist()))
        if res.failed_units:
            raise BenchVerificationError(f"restoring the prefix: {len(res.failed_units)} of {len(keys)} units failed")
        self.read_bps = self._layer_bytes(len(keys)) * self.model.shape.layers / t
        return t

    def poison(self, case: InputCase, prefix: int) -> None:
        """NaN in the prefix's blocks: a layer the system fails to restore shows in its output."""
        self.kv.fill(self._prefix_blocks(case, prefix), float("nan"))
        self._sync()

    def warm_up(self, case: InputCase, prefix: int) -> None:
        """Compiles the attention of this (input, prefix) shape, on one layer."""
        with self._on_stream():
            self.model.prefill(self.kv, case.tokens, prefix, case.block_ids, layers=1)
        self._sync()

    # ---- systems -----------------------------------------------------------------------------------
    def run(self, system: str, case: InputCase, prefix: int, **kw: Any) -> Outcome:
        if system not in SYSTEMS:
            raise ConfigError(f"unknown pipeline system {system!r}; choose from {', '.join(SYSTEMS)}")
        if system == "recompute":
            out, t = self._timed(lambda: self.model.prefill(self.kv, case.tokens, 0, case.block_ids))
            return Outcome(system, t, out)
        self.check_prefix(case, prefix)
        fn = getattr(self, "_" + system.replace("-", "_"))
        result: Outcome = fn(case, prefix, **kw)
        return result

    def _prefill(self, case: InputCase, prefix: int, hooks: LayerHooks | None = None) -> PrefillOutput:
        return self.model.prefill(self.kv, case.tokens, prefix, case.block_ids, hooks)

    def _ideal(self, case: InputCase, prefix: int) -> Outcome:
        self.restore(case, prefix)
        timer = LayerTimer(self.model.shape.layers, self.cuda)
        out, t = self._timed(lambda: self._prefill(case, prefix, _Chain(timer, timer.after_wait)))
        layers = timer.seconds()
        self.layer_seconds[(case.n, prefix)] = layers
        return Outcome("ideal", t, out, timer.parts(layers))

    def _naive(self, case: InputCase, prefix: int) -> Outcome:
        self.poison(case, prefix)
        keys, ids = self._prefix_keys(case, prefix), self._prefix_blocks(case, prefix).tolist()
        layers = self.model.shape.layers
        timer = LayerTimer(layers, self.cuda)

        def go() -> tuple[PrefillOutput, Any]:
            req = self.store.begin_retrieve(keys, ids)
            try:
                out = self._prefill(case, prefix, _Chain(timer, _NaiveHooks(self.store, req, layers, self.naive_ahead),
                                                          timer.after_wait))
            finally:
                res = self.store.finish(req)
            return out, res

        (out, res), t = self._timed(go)
        if res.failed_units:
            raise BenchVerificationError(f"naive: {len(res.failed_units)} of {len(keys)} units failed to load")
        return Outcome("naive", t, out, {"ahead": self.naive_ahead or "all", **timer.parts()})

    def _load_all(self, case: InputCase, prefix: int) -> Outcome:
        self.poison(case, prefix)
        keys, ids = self._prefix_keys(case, prefix), self._prefix_blocks(case, prefix).tolist()
        marks: list[float] = []

        def go() -> PrefillOutput:
            marks.append(time.perf_counter())  # past _timed's barrier: the load alone
            res = self.store.retrieve(keys, ids)
            self._sync()
            marks.append(time.perf_counter())
            if res.failed_units:
                raise BenchVerificationError(f"load-all: {len(res.failed_units)} of {len(keys)} units failed")
            return self._prefill(case, prefix)

        out, t = self._timed(go)
        return Outcome("load-all", t, out, {"load_s": marks[1] - marks[0]})

    def _per_chunk(self, case: InputCase, prefix: int) -> Outcome:
        if self.per_chunk is None:
            raise ConfigError("the per-chunk system needs the per-chunk baseline's files (Harness(per_chunk=...))")
        self.poison(case, prefix)
        self.per_chunk.begin(self._prefix_blocks(case, prefix))
        hooks = _PerChunkHooks(self.per_chunk, self.naive_ahead, self.model.shape.layers)
        out, t = self._timed(lambda: self._prefill(case, prefix, hooks))
        return Outcome("per-chunk", t, out, {"threads": self.per_chunk.threads})

    def slack_windows(self, case: InputCase, prefix: int) -> tuple[list[float], str]:
        """Per-layer slack windows and where they come from: the offline profile when one is loaded,
        else the resident (ideal) run's per-layer times for this input and prefix."""
        if self.windows is not None:
            w = self.windows(case.n, prefix)
            if w is not None:
                return w, "profile"
        got = self.layer_seconds.get((case.n, prefix))
        if got is None:
            raise ConfigError("no slack windows: run 'ideal' for this (input, prefix) first or load a profile")
        return got, "resident run"

    def _tutti(self, case: InputCase, prefix: int, writeback: bool = False, decode_steps: int = 0) -> Outcome:
        self.poison(case, prefix)
        keys, ids = self._prefix_keys(case, prefix), self._prefix_blocks(case, prefix)
        layers = self.model.shape.layers
        windows, source = self.slack_windows(case, prefix)
        if not self.read_bps:
            raise ConfigError("no read bandwidth estimate: restore a prefix first")
        ioctx = len(keys) * self.objs_per_layer
        per_ioctx = self._layer_bytes(len(keys)) / self.read_bps / ioctx
        # The suffix's whole units: the new KV this request writes back.
        first_unit = prefix // self.unit_tokens
        new_units = case.n // self.unit_tokens - first_unit
        wkeys: list[int] = []
        if writeback and new_units:
            wkeys = [int(k) for k in self._rng.integers(1, 2**63 - 1, size=new_units)]
            case.write_keys.extend(wkeys)
        write_ids = case.block_ids[first_unit * self.unit_tokens // self.bt :].tolist()
        # A decode step's slack: the I/O partition idles for a whole step (no reads in decode).
        decode_window = self.itl_s.get(case.n) or (self.itl(case, 2) if decode_steps else 0.0)
        sched_box: list[SlackScheduler] = []
        meters: list[_CpuMeter] = []
        itl: list[float] = []
        writing: list[bool] = []
        timer = LayerTimer(layers, self.cuda)

        def go() -> PrefillOutput:
            req = self.store.begin_retrieve(keys, ids.tolist())
            wreq = self.store.begin_store(wkeys, write_ids) if wkeys else None
            sched = SlackScheduler(
                self.store, layers=layers, windows=windows, read_req=req, read_ioctx=ioctx,
                read_seconds_per_ioctx=per_ioctx, write_req=wreq,
                write_seconds_per_layer=self._layer_bytes(len(wkeys)) / max(self.write_bps, 1.0),
                decode_window=decode_window, iocb_ioctx=self.iocb_ioctx, reads=self.tutti_reads,
                read_ahead=self.read_ahead,
            )
            sched_box.append(sched)
            meters.append(_CpuMeter(sched))
            try:
                out = self._prefill(case, prefix, _Chain(timer, meters[0], timer.after_wait))
            finally:
                sched.finish_reads()
                res = self.store.finish(req)
            # finish counts the layers gio_uring IOCBs moved as well as retrieve_layer's.
            if res.failed_units:
                raise BenchVerificationError(f"tutti: {len(res.failed_units)} of {len(keys)} units failed to load")
            return out

        out, t = self._timed(go)
        sched = sched_box[0]
        base: list[float] = []
        if decode_steps:
            itl = self.decode(case, decode_steps, sched, writing)
        report = sched.flush()
        self._sync()
        if decode_steps and wkeys:
            # The same steps again with no I/O, right after: the baseline of the write-back's ITL,
            # under the same conditions (an earlier baseline met other clocks, caches and kernels).
            base = self.decode(case, decode_steps)
        if report.failed_iocbs:
            raise BenchVerificationError(f"tutti: {report.failed_iocbs} read IOCBs failed")
        schedule = {**report.as_dict(), "reads": self.tutti_reads, "read_ahead": self.read_ahead or "windows"}
        extra: dict[str, Any] = {"schedule": schedule, "windows_ms": [round(w * 1e3, 3) for w in windows],
                                 "windows_from": source, **timer.parts(),
                                 "host_cpu_us_per_layer": round(meters[0].ns / layers / 1e3, 2)}
        if itl:
            extra["itl_s"] = statistics.median(itl)
            if base:
                extra["itl_base_s"] = statistics.median(base)
            # Step by step, and which steps issued writes: against the same steps of a run without
            # write-back (the bench's tutti row), right after the same prefill.
            extra["itl_steps_s"] = itl
            extra["write_step_flags"] = writing
        return Outcome("tutti", t, out, extra)

    # ---- decode ------------------------------------------------------------------------------------
    def decode(self, case: InputCase, steps: int, sched: SlackScheduler | None = None,
               writing: list[bool] | None = None) -> list[float]:
        """``steps`` decode steps after the input (timed one by one, on the compute stream); the
        scheduler, when given, flushes its deferred writes into them (``writing`` gets, per step,
        whether it issued any). The KV goes into the blocks after the input's."""
        n = case.n
        need = -(-(n + steps) // self.bt)
        if need > self.kv.max_blocks:
            raise ConfigError(f"{steps} decode steps after {n} tokens need {need} blocks; the cache has "
                              f"{self.kv.max_blocks}")
        table = torch.arange(need, dtype=torch.int64)
        token = int(case.tokens[-1])
        times = []
        for i in range(steps):
            def step() -> None:
                if sched is not None:
                    sched.decode_step()
                self.model.decode_step(self.kv, token, n + i, table)

            before = len(sched.report.writes_in_decode) if sched is not None else 0
            times.append(self._timed_step(step))
            if writing is not None:
                writing.append(sched is not None and len(sched.report.writes_in_decode) > before)
        return times

    def itl(self, case: InputCase, steps: int) -> float:
        """Median inter-token latency of ``steps`` decode steps with no I/O (kept per input as the
        scheduler's decode window)."""
        if not steps:
            return 0.0
        # One untimed step first: the first decode step after a prefill also compiles and warms the
        # decode kernels, which would make the no-I/O baseline slower than any later step.
        self.decode(case, 1)
        t = self.itl_s[case.n] = statistics.median(self.decode(case, steps))
        return t


def crossover_hit_rate(points: Sequence[tuple[float, float, float]]) -> float | None:
    """The hit rate at which restoring the prefix takes as long as computing the suffix.

    ``points``: (hit rate, load seconds, ideal seconds), any order. Linear interpolation of
    ``load - ideal`` between neighbouring hit rates; None when I/O never dominates in the range
    (the crossover lies above the largest hit rate measured), 0.0 when it dominates everywhere.
    """
    pts = sorted(points)
    if not pts:
        return None
    d = [(h, load - ideal) for h, load, ideal in pts]
    if d[0][1] >= 0:
        return d[0][0] if len(d) == 1 else 0.0
    for (h0, d0), (h1, d1) in zip(d, d[1:]):
        if d0 < 0 <= d1:
            return h0 + (h1 - h0) * (-d0) / (d1 - d0)
    return None


@dataclass(frozen=True)
class Prices:
    """Prices of the cost formula (``tutti bench --pipeline`` flags; defaults are rough public cloud
    list prices, 2026: an H200 GPU-hour, DRAM and NVMe per GB-hour)."""

    gpu_per_hour: float = 3.50
    dram_per_gb_hour: float = 0.004
    ssd_per_gb_hour: float = 0.0001
    gpus: int = 1

    def __post_init__(self) -> None:
        if min(self.gpu_per_hour, self.dram_per_gb_hour, self.ssd_per_gb_hour) < 0 or self.gpus < 1:
            raise ConfigError("prices must be non-negative and gpus at least 1")


def cost_per_million(prices: Prices, *, ttft_s: float, itl_s: float, output_tokens: int, dram_gb: float,
                     ssd_gb: float) -> float:
    """The paper's cost per 1M generated tokens:
    ``(P_gpu * N_gpu + P_mem * S_mem + P_ssd * S_ssd) / throughput(tokens/hour) * 1e6``, with the
    throughput of one request at a time: ``output_tokens`` generated per ``ttft + output_tokens * itl``."""
    if output_tokens <= 0:
        raise ConfigError("output_tokens must be positive")
    seconds = ttft_s + output_tokens * itl_s
    per_hour = output_tokens * 3600.0 / seconds
    dollars = prices.gpu_per_hour * prices.gpus + prices.dram_per_gb_hour * dram_gb + prices.ssd_per_gb_hour * ssd_gb
    return dollars / per_hour * 1e6

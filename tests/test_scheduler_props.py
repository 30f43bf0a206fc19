"""Property tests of the slack-aware scheduler (hypothesis) on a real store (CPU backend, files
under a temporary directory): whatever the windows, costs, IOCB sizes, read-ahead and decode
steps, every IOCTX of the prefix is read exactly once and before its layer's attention, reads come
before writes in a window and writes only where the next read did not fit, a window's
estimated I/O fits it unless retrieval is the bottleneck
(then everything left goes at once), writes follow their layer's compute, every layer is written
once, and what lands in the cache and in the store is byte for byte what was there to move."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the pipeline's model is a torch model")

from hypothesis import given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tutti_cluster import TuttiConfig, TuttiStore  # noqa: E402
from tutti_cluster.bench.prefill import harness as hz  # noqa: E402
from tutti_cluster.bench.prefill.model import Decoder, PagedKV, model_shape  # noqa: E402
from tutti_cluster.pipeline.scheduler import SlackScheduler  # noqa: E402

SHAPE = model_shape("tiny")
UNIT = 256
N = 1024


class Recording:
    """The real store, with the scheduler's I/O calls written to ``log`` in order."""

    def __init__(self, store: TuttiStore, ioctx: int, log: list[tuple[Any, ...]]) -> None:
        self._s, self._ioctx, self.log = store, ioctx, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)

    def fill_iocb(self, iocb: int, **kw: Any) -> None:
        self.log.append(("read", kw["layer"], kw["first"], kw["count"]))
        self._s.fill_iocb(iocb, **kw)

    def retrieve_layer(self, layer: int, req: int, *a: Any) -> None:
        self.log.append(("read", layer, 0, self._ioctx))
        self._s.retrieve_layer(layer, req, *a)

    def store_layer(self, layer: int, req: int, *a: Any) -> None:
        self.log.append(("write", layer))
        self._s.store_layer(layer, req, *a)


params = st.fixed_dictionaries({
    "reads": st.sampled_from(["iocb", "layer"]),
    "units": st.integers(1, 2),
    "windows": st.lists(st.floats(0.0, 8.0), min_size=SHAPE.layers, max_size=SHAPE.layers),
    "per_ioctx": st.floats(0.05, 2.0),
    "iocb_ioctx": st.sampled_from([1, 2, 3, 8]),
    "read_ahead": st.integers(0, 3),
    "write": st.booleans(),
    "write_cost": st.floats(0.0, 4.0),
    "decode_window": st.floats(0.0, 8.0),
    "decode_steps": st.integers(0, 3),
})


def test_scheduler_call_sequences_keep_their_invariants(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    kv = PagedKV(SHAPE, 2 * N // SHAPE.block_tokens, cpu)
    (tmp_path / "store").mkdir()
    store = TuttiStore(TuttiConfig(paths=[tmp_path / "store"], capacity_gb=0.25, unit_tokens=UNIT, backend="cpu",
                                   staging_mb=16))
    store.register_kv_caches(kv.layers, block_tokens=SHAPE.block_tokens, layout="kv_first")
    h = hz.Harness(Decoder(SHAPE, cpu, seed=3), kv, store)
    case = h.new_case(N, N // 2)
    h.prepare(case, compute=False)
    layers, bt = SHAPE.layers, SHAPE.block_tokens
    stored = kv.all[:, :, case.block_ids[: N // 2 // bt]].clone()
    serial = iter(range(1, 1 << 30))

    @settings(max_examples=40, deadline=None)
    @given(p=params)
    def run(p: dict[str, Any]) -> None:
        units = p["units"]
        prefix_ids = case.block_ids[: units * UNIT // bt]
        write_ids = case.block_ids[N // 2 // bt: N // 2 // bt + UNIT // bt]  # one unit of new KV
        ioctx = units * h.objs_per_layer
        kv.fill(prefix_ids, float("nan"))
        kv.randomize(write_ids, next(serial))
        written = kv.all[:, :, write_ids].clone()
        wkeys = [1_000_000 + next(serial)] if p["write"] else []
        log: list[tuple[Any, ...]] = []
        rec = Recording(store, ioctx, log)
        rreq = store.begin_retrieve(case.keys[:units], prefix_ids.tolist())
        wreq = store.begin_store(wkeys, write_ids.tolist()) if wkeys else None
        sched = SlackScheduler(rec, layers=layers, windows=p["windows"], read_req=rreq, read_ioctx=ioctx,
                               read_seconds_per_ioctx=p["per_ioctx"], write_req=wreq,
                               write_seconds_per_layer=p["write_cost"], decode_window=p["decode_window"],
                               iocb_ioctx=p["iocb_ioctx"], reads=p["reads"], read_ahead=p["read_ahead"])
        for l in range(layers):
            log.append(("before_layer", l))
            sched.before_layer(l)
            log.append(("attention", l))
            sched.before_attention(l)
            log.append(("after", l))
            sched.after_layer(l)
        for _ in range(p["decode_steps"]):
            log.append(("decode",))
            sched.decode_step()
        log.append(("flush",))
        report = sched.flush()
        res = store.finish(rreq)
        note(f"log {log}")
        piece = ioctx if p["reads"] == "layer" else min(p["iocb_ioctx"], ioctx)

        # Every IOCTX of every layer read exactly once, before that layer's attention.
        at = {e: i for i, e in enumerate(log) if e[0] in ("before_layer", "attention", "after")}
        reads = [(i, e) for i, e in enumerate(log) if e[0] == "read"]
        for l in range(layers):
            spans = sorted((first, count) for i, (_, layer, first, count) in reads if layer == l)
            assert [f for f, _ in spans] == list(range(0, ioctx, piece))
            assert sum(c for _, c in spans) == ioctx
            assert all(i < at[("attention", l)] for i, e in reads if e[1] == l)
        assert report.failed_iocbs == 0 and not res.failed_units
        # Per window (between layer l's attention and its end): reads before writes, reads no
        # further ahead than read_ahead and within the window's budget, unless every read left went.
        for l in range(layers):
            window = log[at[("attention", l)] + 1: at[("after", l)]]
            kinds = [e[0] for e in window]
            assert "read" not in kinds[kinds.index("write"):] if "write" in kinds else True
            later = any(i > at[("after", l)] for i, _ in reads)
            ahead = [e for e in window if e[0] == "read"]
            if later:  # not the "retrieval is the bottleneck" case
                if p["read_ahead"]:
                    assert all(e[1] <= l + p["read_ahead"] for e in ahead)
                reads_cost = sum(e[3] for e in ahead) * p["per_ioctx"]
                spent = reads_cost + kinds.count("write") * p["write_cost"]
                assert spent <= p["windows"][l] * (1 + 1e-9) + 1e-9
                if "write" in kinds:  # writes only where the next read waiting did not fit
                    nxt = next(e for i, e in reads if i > at[("after", l)])
                    assert nxt[3] * p["per_ioctx"] > p["windows"][l] - reads_cost - 1e-9
            elif kinds.count("write"):
                spent = kinds.count("write") * p["write_cost"]
                assert spent <= p["windows"][l] * (1 + 1e-9) + 1e-9
        # Writes only of layers whose compute is done; each layer once; all committed.
        writes = [(i, e[1]) for i, e in enumerate(log) if e[0] == "write"]
        assert all(i > at[("after", layer)] for i, layer in writes)
        if wkeys:
            assert sorted(layer for _, layer in writes) == list(range(layers))
            assert report.committed_units == [0] and store.lookup(wkeys) == 1
        else:
            assert not writes
        # The cache holds the stored prefix; the store holds what the write blocks held.
        assert torch.equal(kv.all[:, :, prefix_ids], stored[:, :, : prefix_ids.numel()])
        if wkeys:
            kv.fill(write_ids, float("nan"))
            assert not store.retrieve(wkeys, write_ids.tolist()).failed_units
            assert torch.equal(kv.all[:, :, write_ids], written)
            store.remove(wkeys[0])

    try:
        run()
    finally:
        store.close()

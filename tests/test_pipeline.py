"""The layer-wise prefill pipeline on the CPU backend, tiny model shape: the prefix restored from a
real store layer by layer gives the resident run's output bit for bit, in every system; the
scheduler never loses a write; the block mask matches the dense lower-right causal mask; bad
arguments are ConfigErrors. No figure is asserted on."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the pipeline's model is a torch model")

from tutti_cluster import TuttiConfig, TuttiStore  # noqa: E402
from tutti_cluster.bench import main as bench_main  # noqa: E402
from tutti_cluster.bench.baselines import LayerwisePerChunk  # noqa: E402
from tutti_cluster.bench.prefill import harness as hz  # noqa: E402
from tutti_cluster.bench.prefill.model import (  # noqa: E402
    Decoder, PagedKV, attention, lower_right_block_mask, model_shape,
)
from tutti_cluster.errors import ConfigError  # noqa: E402
from tutti_cluster.pipeline.scheduler import SlackScheduler  # noqa: E402

CPU = torch.device("cpu")
SHAPE = model_shape("tiny")
UNIT = 256
N = 1024


@pytest.fixture()
def rig(tmp_path: Path):
    """Model, cache, a real store on a temporary directory and the per-chunk files, as the bench has them."""
    kv = PagedKV(SHAPE, 2 * N // SHAPE.block_tokens, CPU)
    model = Decoder(SHAPE, CPU, seed=3)
    store = TuttiStore(TuttiConfig(paths=[tmp_path / "store"], capacity_gb=0.25, unit_tokens=UNIT, backend="cpu",
                                   staging_mb=16))
    (tmp_path / "store").mkdir()
    (tmp_path / "chunks").mkdir()
    store.register_kv_caches(kv.layers, block_tokens=SHAPE.block_tokens, layout="kv_first")
    reader = LayerwisePerChunk(kv, [tmp_path / "chunks"], threads=2)  # type: ignore[arg-type]
    h = hz.Harness(model, kv, store, per_chunk=reader, iocb_ioctx=2)
    try:
        yield h
    finally:
        reader.close()
        store.close()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_mask_matches_the_dense_lower_right_causal_mask() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    for q_len, kv_len, block in ((100, 260, 32), (64, 64, 32), (33, 300, 16), (1, 97, 32)):
        q = torch.randn(q_len, 4, 16, generator=g)
        k, v = torch.randn(2, kv_len, 2, 16, generator=g)
        mask = lower_right_block_mask(q_len, kv_len, CPU, block=block)
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        got = flex_attention(qh, kh, vh, block_mask=mask, enable_gqa=True)
        dense = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        want = torch.nn.functional.scaled_dot_product_attention(
            qh, kh.repeat_interleave(2, 1), vh.repeat_interleave(2, 1), attn_mask=dense)
        assert torch.allclose(got, want, atol=1e-5), (q_len, kv_len)
        # SDPA's causal_lower_right, the CPU path and the CUDA fallback, agrees as well.
        assert torch.allclose(attention(q, k, v, "sdpa"), want.squeeze(0).transpose(0, 1), atol=1e-5)
        # So does the split form: flash attention over the prefix and over the suffix, merged.
        assert torch.allclose(attention(q, k, v, "split"), want.squeeze(0).transpose(0, 1), atol=1e-5)
        # The mask is block indices, never q_len x kv_len.
        assert mask.kv_indices.numel() == -(-q_len // block) * -(-kv_len // block)


def test_a_paged_prefill_with_a_permuted_block_table_matches_the_contiguous_one() -> None:
    kv = PagedKV(SHAPE, 2 * N // SHAPE.block_tokens, CPU)
    model = Decoder(SHAPE, CPU, seed=1)
    tokens = torch.randint(0, SHAPE.vocab, (N,), generator=torch.Generator().manual_seed(1))
    ids = torch.arange(N // SHAPE.block_tokens)
    perm = torch.randperm(2 * N // SHAPE.block_tokens, generator=torch.Generator().manual_seed(2))[: ids.numel()]
    full = model.prefill(kv, tokens, 0, ids)
    resumed = model.prefill(kv, tokens, 512, ids)  # the prefix's KV left by the full run
    assert torch.isfinite(full.logits).all()
    a = model.prefill(kv, tokens, 0, perm)
    assert torch.equal(a.logits, full.logits)
    assert torch.allclose(model.prefill(kv, tokens, 512, perm).logits, resumed.logits)


def test_every_system_restores_the_prefix_to_the_resident_output(rig: hz.Harness) -> None:
    case = rig.new_case(N, N - UNIT)
    rec = rig.prepare(case)
    assert rec is not None and rec.ttft_s > 0
    for prefix in (UNIT, N // 2, N - UNIT):
        rig.warm_up(case, prefix)
        ideal = rig.run("ideal", case, prefix)
        for system in ("tutti", "naive", "load-all", "per-chunk"):
            out = rig.run(system, case, prefix)
            c = hz.compare(ideal.out, out.out)
            assert c["exact"], (system, prefix, c)
        # Without a restore the NaN-filled prefix shows in the output: the check has teeth.
        rig.poison(case, prefix)
        broken = rig.model.prefill(rig.kv, case.tokens, prefix, case.block_ids)
        assert not hz.compare(ideal.out, broken)["exact"]
    comp = hz.compare(rec.out, rig.run("ideal", case, N // 2).out)
    assert comp["max_abs_diff"] <= hz.RECOMPUTE_RTOL * comp["logit_scale"]
    rig.release(case)
    assert rig.store.lookup(case.keys) == 0


@pytest.mark.parametrize("reads", ["iocb", "layer"])
def test_the_scheduler_commits_or_reports_every_write(rig: hz.Harness, reads: str) -> None:
    rig.tutti_reads = reads
    case = rig.new_case(N, N // 2)
    rig.prepare(case, compute=False)
    ideal = rig.run("ideal", case, N // 4)
    out = rig.run("tutti", case, N // 4, writeback=True, decode_steps=2)
    assert hz.compare(ideal.out, out.out)["exact"]
    sched = out.extra["schedule"]
    units = (N - N // 4) // UNIT
    assert sched["store_units"] == units
    assert sched["committed_units"] + sched["skipped_units"] + sched["not_stored_units"] == units
    assert sched["writes_in_prefill"] + sched["writes_in_decode"] + sched["writes_flushed"] == SHAPE.layers
    assert rig.store.lookup(case.write_keys) == sched["committed_units"] == units
    rig.release(case)


def test_writes_with_no_slack_are_flushed_not_lost(rig: hz.Harness) -> None:
    """Windows of zero: no write fits anywhere, so every layer is written at flush and committed."""
    case = rig.new_case(N, N // 2)
    rig.prepare(case, compute=False)
    store = rig.store
    keys = [7001, 7002]
    wreq = store.begin_store(keys, case.block_ids[N // 2 // SHAPE.block_tokens:].tolist())
    rreq = store.begin_retrieve(case.keys[:2], case.block_ids[: N // 2 // SHAPE.block_tokens].tolist())
    sched = SlackScheduler(store, layers=SHAPE.layers, windows=[0.0] * SHAPE.layers, read_req=rreq,
                           read_ioctx=2 * rig.objs_per_layer, read_seconds_per_ioctx=1.0, write_req=wreq,
                           write_seconds_per_layer=1.0, decode_window=0.0, iocb_ioctx=1)
    rig.model.prefill(rig.kv, case.tokens, N // 2, case.block_ids, sched)
    sched.decode_step()
    assert sched.pending_writes == SHAPE.layers  # nothing fitted
    report = sched.flush()
    store.finish(rreq)
    assert report.reads_issued_at_once == report.read_iocbs == SHAPE.layers * 2 * rig.objs_per_layer
    assert len(report.writes_flushed) == SHAPE.layers and report.failed_iocbs == 0
    assert sorted(report.committed_units) == [0, 1] and store.lookup(keys) == 2
    assert sched.flush() is report  # idempotent


def test_bad_arguments_are_config_errors(rig: hz.Harness, tmp_path: Path) -> None:
    case = rig.new_case(N, N // 2)
    with pytest.raises(ConfigError, match="multiple of unit_tokens"):
        rig.new_case(N + 16, N // 2)
    with pytest.raises(ConfigError, match="exceeds"):
        rig.run("naive", case, N - UNIT)
    with pytest.raises(ConfigError, match="unknown pipeline system"):
        rig.run("magic", case, UNIT)
    with pytest.raises(ConfigError, match="no slack windows"):
        rig.run("tutti", case, UNIT)
    with pytest.raises(ConfigError, match="prefix of 100"):
        rig.model.prefill(rig.kv, case.tokens, 100, case.block_ids)
    with pytest.raises(ConfigError, match="unknown model shape"):
        model_shape("gpt-9")
    with pytest.raises(ConfigError, match="slack windows for"):
        SlackScheduler(rig.store, layers=4, windows=[0.0], read_req=None, read_ioctx=0, read_seconds_per_ioctx=0.0)
    with pytest.raises(ConfigError, match="iocb_ioctx"):
        SlackScheduler(rig.store, layers=1, windows=[0.0], read_req=None, read_ioctx=0, read_seconds_per_ioctx=0.0,
                       iocb_ioctx=4096)
    with pytest.raises(ConfigError, match="output_tokens"):
        hz.cost_per_million(hz.Prices(), ttft_s=1, itl_s=0.01, output_tokens=0, dram_gb=0, ssd_gb=0)
    base = ["--pipeline", "--device", "cpu", "--paths", str(tmp_path)]
    for extra, words in ((["--inputs", "1000"], "multiple of unit_tokens"), (["--systems", "magic"], "unknown pipeline"),
                         (["--prefix-tokens", "150%"], "strictly between"), (["--repeat", "0"], "--repeat"),
                         (["--iocb-ioctx", "0"], "--iocb-ioctx"),
                         (["--profile", str(tmp_path / "none.json")], "no such file")):
        with pytest.raises(ConfigError, match=words):
            bench_main(base + extra)


def test_crossover_and_cost_formulas() -> None:
    assert hz.crossover_hit_rate([(0.5, 1.0, 3.0), (0.9, 2.0, 1.0)]) == pytest.approx(0.5 + 0.4 * 2 / 3)
    assert hz.crossover_hit_rate([(0.5, 1.0, 3.0), (0.9, 1.0, 2.0)]) is None
    assert hz.crossover_hit_rate([(0.5, 4.0, 3.0), (0.9, 5.0, 2.0)]) == 0.0
    p = hz.Prices(gpu_per_hour=3.6, dram_per_gb_hour=0.0, ssd_per_gb_hour=0.0)
    # 100 tokens in 1 + 100 * 0.01 = 2 s: 180,000 tokens an hour; $3.6 / 180,000 * 1e6 = $20.
    assert hz.cost_per_million(p, ttft_s=1.0, itl_s=0.01, output_tokens=100, dram_gb=1, ssd_gb=1) == pytest.approx(20.0)


def test_bench_pipeline_cpu_mode_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    store = tmp_path / "store"
    store.mkdir()
    rc = bench_main(["--pipeline", "--device", "cpu", "--paths", str(store), "--inputs", "1K",
                     "--prefix-tokens", "50%,-1u", "--decode-steps", "2", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(out.read_text())
    assert {"machine", "model", "prices", "results", "summary"} <= set(report)
    got = {(r["system"], r["prefix_tokens"]) for r in report["results"]}
    want = {(s, p) for s in ("ideal", "tutti", "tutti-writeback", "naive", "load-all", "per-chunk")
            for p in (512, 768)} | {("recompute", 0)}
    assert got == want
    for r in report["results"]:
        assert r["ttft_s"] > 0 and r["cost_per_1m_tokens"] > 0
        if r["system"] != "recompute":
            assert r["matches_ideal"] == "bitwise" and "bubble_s" in r
        if r["system"] == "tutti-writeback":  # against the same steps with no I/O, right after
            assert r["itl_base_s"] > 0
            assert r["itl_increase"] == pytest.approx(r["itl_s"] / r["itl_base_s"] - 1, abs=1e-3)
            # Against tutti's own decode after the same prefill: the steps that wrote, named.
            assert r["itl_plain_s"] > 0 and r["decode_vs_plain"] > -1
            assert bool(r["write_steps"]) == bool(r["schedule"]["writes_in_decode"])
            assert (r["write_steps_vs_plain"] is None) == (not r["write_steps"])
        if r["system"] in ("ideal", "tutti", "naive"):  # per-layer compute, waits included
            assert len(r["layer_ms"]) == report["model"]["layers"] and min(r["layer_ms"]) > 0
            # The waits before attention are part of their layers' times.
            assert len(r["wait_ms"]) == len(r["layer_ms"])
            assert all(0 <= w <= t for w, t in zip(r["wait_ms"], r["layer_ms"]))
    summary = report["summary"]["1024"]
    assert "crossover_hit_rate" in summary
    below = [r["bubble_s"] for r in report["results"] if r["system"] == "tutti"
             and (summary["crossover_hit_rate"] is None or r["hit_rate"] < summary["crossover_hit_rate"])]
    assert summary["tutti_median_bubble_below_crossover_s"] == (
        pytest.approx(statistics.median(below), abs=1e-5) if below else None)
    assert not [p for p in store.iterdir() if p.name.startswith("tutti-bench-")]


def test_profile_writes_a_keyed_table_the_bench_reads(tmp_path: Path) -> None:
    from tutti_cluster.cli import main as tutti_main
    from tutti_cluster.pipeline.table import SlackTable

    out = tmp_path / "prof.json"
    assert tutti_main(["profile", "--device", "cpu", "--inputs", "1K", "--prefix-tokens", "0%,50%,-1u",
                       "--data-dir", str(tmp_path), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(g["input"], g["prefix"]) for g in data["grid"]] == [(1024, 0), (1024, 512), (1024, 768)]
    table = SlackTable.load(out, SHAPE, CPU, 0)
    a, b = table.windows(1024, 512), table.windows(1024, 768)
    mid = table.windows(1024, 640)  # between two grid points: interpolated
    assert all(min(x, y) <= m <= max(x, y) for x, y, m in zip(a, b, mid))
    assert table.windows(1024, 500) == table.windows(1024, 512)  # rounded to the 32-token grid
    with pytest.raises(ConfigError, match="was made for"):
        SlackTable.load(out, model_shape("tiny", layers=2), CPU, 0)
    store = tmp_path / "store"
    store.mkdir()
    j = tmp_path / "p.json"
    assert bench_main(["--pipeline", "--device", "cpu", "--paths", str(store), "--inputs", "1K", "--prefix-tokens",
                       "50%", "--systems", "tutti", "--no-writeback", "--profile", str(out), "--json", str(j)]) == 0
    rows = [r for r in json.loads(j.read_text())["results"] if r["system"] == "tutti"]
    assert rows and rows[0]["windows_from"] == "profile"


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_compiled_flex_attention_restores_bitwise_and_matches_sdpa(tmp_path: Path) -> None:
    """The CUDA path's kernel, compiled here for the CPU: the block mask through compiled
    flex_attention, restored prefixes bitwise equal to the resident run, and close to SDPA."""
    kv = PagedKV(SHAPE, 2 * N // SHAPE.block_tokens, CPU)
    flex = Decoder(SHAPE, CPU, seed=3, attention="flex")
    store = TuttiStore(TuttiConfig(paths=[tmp_path], capacity_gb=0.25, unit_tokens=UNIT, backend="cpu",
                                   staging_mb=16))
    store.register_kv_caches(kv.layers, block_tokens=SHAPE.block_tokens, layout="kv_first")
    try:
        h = hz.Harness(flex, kv, store)
        case = h.new_case(N, N // 2)
        h.prepare(case, compute=False)
        assert flex.attention_kind(N // 2, N) == "flex"
        ideal = h.run("ideal", case, N // 2)
        for system in ("naive", "tutti"):
            assert hz.compare(ideal.out, h.run(system, case, N // 2).out)["exact"], system
        h.restore(case, N // 2)
        sdpa = Decoder(SHAPE, CPU, seed=3, attention="sdpa").prefill(kv, case.tokens, N // 2, case.block_ids)
        c = hz.compare(ideal.out, sdpa)
        assert c["max_abs_diff"] <= 0.05 * c["logit_scale"], c
    finally:
        store.close()


def test_reads_fill_windows_in_order_and_go_at_once_when_none_fits(rig: hz.Harness) -> None:
    case = rig.new_case(N, N // 2)
    rig.prepare(case, compute=False)
    store, layers = rig.store, SHAPE.layers
    ids = case.block_ids[: N // 2 // SHAPE.block_tokens].tolist()
    ioctx = 2 * rig.objs_per_layer  # two units, one IOCB each per layer with iocb_ioctx=2

    def issued_by_layer(windows: list[float], read_ahead: int = 0) -> tuple[list[int], list[int]]:
        req = store.begin_retrieve(case.keys[:2], ids)
        sched = SlackScheduler(store, layers=layers, windows=windows, read_req=req, read_ioctx=ioctx,
                               read_seconds_per_ioctx=1.0, iocb_ioctx=2, read_ahead=read_ahead)
        counts, own = [], []
        for l in range(layers):
            before = sched.report.read_iocbs
            sched.before_layer(l)
            own.append(sched.report.read_iocbs - before)  # the layer's own reads, alone
            sched.before_attention(l)  # after they landed: what fills the window
            counts.append(sched.report.read_iocbs - before)
        sched.finish_reads()
        store.finish(req)
        assert sched.report.failed_iocbs == 0
        return counts, own

    # Two IOCBs per layer, 2 s each. A 2 s window takes one IOCB ahead: layer 0's two now plus the
    # first half of layer 1; then each layer's second half now plus the next layer's first half.
    assert issued_by_layer([2.0] * layers) == ([3, 2, 2, 1], [2, 1, 1, 1])
    total = 2 * layers
    assert issued_by_layer([1.5] * layers) == ([total, 0, 0, 0], [2, 0, 0, 0])  # none fits: all at once
    assert issued_by_layer([100.0] * layers) == ([total, 0, 0, 0], [2, 0, 0, 0])  # all fit the first window
    # With read_ahead=1 a window reaches only the next layer, however much room it has.
    assert issued_by_layer([100.0] * layers, read_ahead=1) == ([4, 2, 2, 0], [2, 0, 0, 0])


# ---- on the GPU host (pytest -m gpu tests/test_pipeline.py) ---------------------------------------


def _gpu_reason() -> str | None:
    from tutti_cluster import _native

    if not _native.has_cuda:
        return "this build of the native module has no CUDA backend"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_gpu_split_attention_matches_sdpa_in_bf16() -> None:
    """The split form through CUDA's flash kernel, against SDPA's lower-right causal mask (bf16)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    for q_len, kv_len in ((4096, 4096), (3000, 8192), (1, 5000), (256, 257)):
        q = torch.randn(q_len, 32, 128, generator=g, device=dev, dtype=torch.bfloat16)
        k, v = torch.randn(2, kv_len, 8, 128, generator=g, device=dev, dtype=torch.bfloat16)
        diff = (attention(q, k, v, "split").float() - attention(q, k, v, "sdpa").float()).abs().max().item()
        assert diff <= 0.02, (q_len, kv_len, diff)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("reads", ["layer", "iocb"])
def test_gpu_every_system_restores_bitwise_with_compiled_flex(tmp_path: Path, reads: str) -> None:
    """The CUDA store, flex_attention compiled for the GPU, the compute on the store's compute
    stream: every restoring system equals the resident run bit for bit, write-back commits."""
    dev = torch.device("cuda", torch.cuda.current_device())
    shape = model_shape("tiny")
    n = 4096
    kv = PagedKV(shape, 2 * n // shape.block_tokens, dev)
    model = Decoder(shape, dev, seed=5)
    store = TuttiStore(TuttiConfig(paths=[tmp_path / "s"], capacity_gb=0.5, unit_tokens=UNIT, backend="cuda",
                                   staging_mb=32))
    (tmp_path / "s").mkdir()
    (tmp_path / "c").mkdir()
    store.register_kv_caches(kv.layers, block_tokens=shape.block_tokens, layout="kv_first")
    reader = LayerwisePerChunk(kv, [tmp_path / "c"], threads=4)  # type: ignore[arg-type]
    try:
        h = hz.Harness(model, kv, store, per_chunk=reader, tutti_reads=reads)
        case = h.new_case(n, n - UNIT)
        h.prepare(case)
        h.itl(case, 2)
        for prefix in (UNIT, n // 2, n - UNIT):
            h.warm_up(case, prefix)
            ideal = h.run("ideal", case, prefix)
            for system in ("tutti", "naive", "load-all", "per-chunk"):
                c = hz.compare(ideal.out, h.run(system, case, prefix).out)
                assert c["exact"], (system, prefix, c)
            wb = h.run("tutti", case, prefix, writeback=True, decode_steps=2)
            assert hz.compare(ideal.out, wb.out)["exact"]
            sched = wb.extra["schedule"]
            assert sched["committed_units"] + sched["skipped_units"] == sched["store_units"]
            for k in case.write_keys:
                store.remove(k)
            case.write_keys.clear()
        h.release(case)
    finally:
        reader.close()
        store.close()

"""Tensor parallelism in the pipeline benchmark, on the CPU with gloo (two real processes): the
ranks' shares of the model compute the whole model, each rank's store restores its share of the
prefix bit for bit, a rank that fails stops the run with its error. The GPU form (NCCL, one GPU
per rank) is the same code with another backend and device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the pipeline's model is a torch model")

from tutti_cluster.bench import main as bench_main  # noqa: E402
from tutti_cluster.bench.errors import RankFailed  # noqa: E402
from tutti_cluster.bench.pipeline import rank_dirs  # noqa: E402
from tutti_cluster.bench.prefill.model import Decoder, PagedKV, TensorParallel, model_shape  # noqa: E402
from tutti_cluster.errors import ConfigError  # noqa: E402

from test_pipeline import _gpu_reason  # noqa: E402

CPU = torch.device("cpu")
SHAPE = model_shape("tiny")
N = 512


def _rank_prefill(rank: int, port: int, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = Decoder(SHAPE, CPU, seed=7, tp=TensorParallel(rank, 2, dist.all_reduce))
        kv = PagedKV(model.shape, N // SHAPE.block_tokens, CPU)
        tokens = torch.arange(N) * 7 % SHAPE.vocab
        res = model.prefill(kv, tokens, 0, torch.arange(N // SHAPE.block_tokens))
        torch.save({"hidden": res.hidden, "logits": res.logits, "kv": kv.all}, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_compute_the_whole_model(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from tutti_cluster.bench.pipeline import _free_port

    mp.start_processes(_rank_prefill, args=(_free_port(), tmp_path), nprocs=2, start_method="spawn")
    whole = Decoder(SHAPE, CPU, seed=7)
    kv = PagedKV(SHAPE, N // SHAPE.block_tokens, CPU)
    ref = whole.prefill(kv, torch.arange(N) * 7 % SHAPE.vocab, 0, torch.arange(N // SHAPE.block_tokens))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    half = SHAPE.kv_heads // 2
    for r, got in enumerate(ranks):
        assert got["kv"].shape[-2] == half
        # Layer 0's K and V come from the embeddings alone: rank r's heads exactly.
        assert torch.equal(got["kv"][0], kv.all[0, ..., r * half : (r + 1) * half, :])
        # Later layers see the group's sums, added in another order than one process adds: bf16-close.
        assert torch.allclose(got["kv"][1:].float(), kv.all[1:, ..., r * half : (r + 1) * half, :].float(),
                              atol=0.1, rtol=0.05)
    # The sum makes the ranks' hidden states one: every rank holds the whole output.
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    scale = ref.logits.abs().max().item()
    assert (ranks[0]["logits"] - ref.logits).abs().max().item() <= 0.05 * scale
    assert ranks[0]["logits"].argmax() == ref.logits.argmax()


def test_bench_pipeline_two_ranks_restore_their_shares(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    paths = [tmp_path / "a", tmp_path / "b"]
    for p in paths:
        p.mkdir()
    rc = bench_main(["--pipeline", "--device", "cpu", "--tp", "2", "--paths", *map(str, paths), "--inputs", "1K",
                     "--prefix-tokens", "50%,-1u", "--decode-steps", "2",
                     "--systems", "ideal,tutti,naive,load-all,recompute", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["machine"]["tensor_parallel"] == {"size": 2, "backend": "gloo"}
    got = {(r["system"], r["prefix_tokens"]) for r in report["results"]}
    assert got == {(s, p) for s in ("ideal", "tutti", "tutti-writeback", "naive", "load-all")
                   for p in (512, 768)} | {("recompute", 0)}
    for r in report["results"]:
        # Every restoring system's output equals the resident run's bit for bit (the bench raises
        # otherwise); recompute, another kernel shape, within bf16.
        assert r["matches_ideal"] == ("within bf16" if r["system"] == "recompute" else "bitwise"), r
        if r["system"] == "tutti":
            assert r["host_cpu_us_per_layer"] > 0
    ranks = report["summary"]["1024"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    # Each rank's own store: its own path (every second path), its own fixed staging area.
    assert [r["paths"] for r in ranks] == [[str(paths[0])], [str(paths[1])]]
    assert ranks[0]["staging_bytes"] == ranks[1]["staging_bytes"] > 0
    assert all(r["read_gbps"] > 0 and r["write_gbps"] > 0 for r in ranks)
    assert report["summary"]["1024"]["read_gbps"] == pytest.approx(sum(r["read_gbps"] for r in ranks), abs=2e-3)
    for p in paths:  # the run's files are gone
        assert not list(p.iterdir())


def test_rank_dirs_split_the_paths_or_give_each_rank_a_directory() -> None:
    a, b, c = Path("/a"), Path("/b"), Path("/c")
    assert rank_dirs([a, b, c], 0, 1) == [a, b, c]
    assert rank_dirs([a, b], 1, 2) == [b]
    assert rank_dirs([a, b, c], 1, 2) == [a / "rank1", b / "rank1", c / "rank1"]


def test_a_failing_rank_stops_the_run_with_its_error(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "rank1").write_text("a file where rank 1's directory goes")
    with pytest.raises(RankFailed, match="rank 1 failed: NotADirectoryError"):
        bench_main(["--pipeline", "--device", "cpu", "--tp", "2", "--paths", str(store), "--inputs", "1K",
                    "--prefix-tokens", "50%", "--systems", "ideal,tutti", "--no-writeback"])
    # Rank 0, stopped, went out through its cleanup: its directory and files are gone.
    assert sorted(p.name for p in store.iterdir()) == ["rank1"]


@pytest.mark.parametrize("argv, match", [
    (["--tp", "3"], "not divisible by the tensor-parallel size 3"),
    (["--tp", "0"], "at least 1"),
    (["--tp", "2", "--systems", "per-chunk"], "per-chunk"),
    (["--tp", "2", "--tp-backend", "nccl"], "needs CUDA"),
    (["--tp", "2", "--profile", "prof.json"], "each rank's resident run"),
])
def test_bad_tensor_parallel_flags_are_config_errors(tmp_path: Path, argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        bench_main(["--pipeline", "--device", "cpu", "--paths", str(tmp_path), *argv])


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_gpu_two_ranks_restore_their_shares_bitwise(tmp_path: Path) -> None:
    """Two ranks with CUDA stores: NCCL on two GPUs; on a host with one GPU, gloo with both ranks
    on it (the code path, not a TP run's timing)."""
    out = tmp_path / "tp.json"
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    rc = bench_main(["--pipeline", "--device", "cuda", "--tp", "2", "--tp-backend", backend, "--model", "tiny",
                     "--paths", str(tmp_path), "--inputs", "4K", "--prefix-tokens", "50%,-1u", "--attention", "split",
                     "--systems", "ideal,tutti,naive,load-all", "--decode-steps", "2", "--staging-mb", "64",
                     "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["machine"]["tensor_parallel"] == {"size": 2, "backend": backend}
    assert all(r["matches_ideal"] == "bitwise" for r in report["results"])
    ranks = report["summary"]["4096"]["ranks"]
    assert [r["device"] for r in ranks] == (["cuda:0", "cuda:1"] if backend == "nccl" else ["cuda:0", "cuda:0"])
    assert all(r["read_gbps"] > 0 and r["peak_gpu_bytes"] > 0 for r in ranks)


def test_two_ranks_in_one_path_share_its_capacity_and_leave_nothing(tmp_path: Path) -> None:
    """One path, two ranks: each in its own rank<r> directory with half the path's --capacity-gb
    (the whole of it would not fit twice), both directories gone after the run."""
    store = tmp_path / "store"
    store.mkdir()
    out = tmp_path / "one.json"
    rc = bench_main(["--pipeline", "--device", "cpu", "--tp", "2", "--paths", str(store), "--capacity-gb", "0.02",
                     "--inputs", "1K", "--prefix-tokens", "50%", "--systems", "ideal,tutti,load-all", "--no-writeback",
                     "--json", str(out)])
    assert rc == 0
    ranks = json.loads(out.read_text())["summary"]["1024"]["ranks"]
    assert [r["paths"] for r in ranks] == [[str(store / "rank0")], [str(store / "rank1")]]
    assert not list(store.iterdir())

"""``tutti bench tiers --device cpu`` on tiny sizes: a real run of both systems (a memory tier on
/dev/shm, storage on the test's disk directory), the report's shape, hits per tier that add up to
the units looked up, and clear errors for a workload that breaks its own definition. No figure is
asserted on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the benchmark moves torch KV tensors")

from tutti_cluster.bench import fsutil  # noqa: E402
from tutti_cluster.bench.tiers import hot_prefixes, main, zipf_weights  # noqa: E402
from tutti_cluster.errors import ConfigError  # noqa: E402

# 2 layers and 16-token units: 128 KiB units, 31 slots per 4 MiB; 32 prefixes of 4 units (16 MiB).
TINY = ["--device", "cpu", "--layers", "2", "--unit-tokens", "16", "--prefixes", "32", "--prefix-units", "4",
        "--capacity-gb", "0.004", "--memory-capacity-gb", "0.004", "--requests", "40", "--warmup", "20",
        "--limit-gb", "0.0625", "--no-drop-caches"]


def test_both_systems_report_hits_per_tier_that_add_up(tmp_path: Path, mem_dir: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    out, png = tmp_path / "tiers.json", tmp_path / "tiers.png"
    assert main([*TINY, "--paths", str(store), "--memory-paths", str(mem_dir), "--json", str(out),
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(store.iterdir()) and not list(mem_dir.iterdir())  # every file of the run is gone
    report = json.loads(out.read_text())
    assert report["bench"] == "tiers"
    lim = report["limits"]
    assert lim["storage_read_gbps"] > 0 and lim["storage_write_gbps"] > 0 and lim["host_copy_gbps"] > 0
    c = report["config"]
    assert c["catalogue_bytes"] > c["memory_bytes"] + c["storage_bytes"]
    assert c["hot_set"]["bytes"] < c["memory_bytes"]
    rows = {r["system"]: r for r in report["results"]}
    assert list(rows) == ["tiered", "single"]
    for name, r in rows.items():
        h = r["hits"]
        # Every unit looked up is a hit in one tier or a miss; the counters agree with the bench's tally.
        assert r["units"] == 40 * 4 == h["memory"] + h["storage"] + h["miss"], (name, r)
        assert r["bench_hit_units"] == h["memory"] + h["storage"], (name, r)
        assert sum(r["hit_rate"].values()) == pytest.approx(1.0)
        assert r["restore_s"]["p50"] <= r["restore_s"]["p99"] <= r["restore_s"]["max"]
        assert r["requests"] == 40 and r["flush_errors"] == 0
    tiered, single = rows["tiered"], rows["single"]
    # The hot prefixes repeat within the memory tier's size: some hits come from memory.
    assert tiered["hits"]["memory"] > 0 and tiered["bytes_read"]["memory"] > 0
    assert tiered["slots"]["memory"] > 0 and tiered["flushes"] > 0
    # One tier: nothing is in memory; the same bytes (slots may round differently).
    assert single["hits"]["memory"] == 0 and single["bytes_read"]["memory"] == 0 and single["slots"]["memory"] == 0
    assert single["slots"]["total"] >= tiered["slots"]["total"] - 2


def test_a_workload_that_breaks_its_definition_is_refused(tmp_path: Path, mem_dir: Path) -> None:
    base = [*TINY, "--paths", str(tmp_path), "--memory-paths", str(mem_dir)]
    with pytest.raises(ConfigError, match="larger than the memory and storage tiers"):
        main([*base, "--prefixes", "8"])
    with pytest.raises(ConfigError, match="hot set"):
        main([*base, "--zipf", "0.2"])
    with pytest.raises(ConfigError, match="unknown systems"):
        main([*base, "--systems", "tiered,lmcache"])
    with pytest.raises(ConfigError, match="--requests"):
        main([*base, "--requests", "0"])
    assert not list(tmp_path.iterdir()) and not list(mem_dir.iterdir())
    if fsutil.fs_type(tmp_path) not in fsutil.MEMORY_FS:
        (tmp_path / "a").mkdir()
        (tmp_path / "m").mkdir()
        with pytest.raises(ConfigError, match="tmpfs, ramfs or hugetlbfs"):
            main([*TINY, "--paths", str(tmp_path / "a"), "--memory-paths", str(tmp_path / "m")])


def test_the_hot_set_is_the_most_popular_prefixes_drawing_half_the_requests() -> None:
    w = zipf_weights(4, 1.0)  # 1, 1/2, 1/3, 1/4 over 25/12
    assert w.sum() == pytest.approx(1.0) and w[0] == pytest.approx(12 / 25)
    assert hot_prefixes(w) == 2  # 12/25 < 0.5 <= 18/25
    assert hot_prefixes(zipf_weights(10, 3.0)) == 1


# --figures: 256 and 512 tokens are 16 and 32 of those 128 KiB units; a 30 MiB flush backlog.
FIGURES = ["--figures", "--device", "cpu", "--layers", "2", "--unit-tokens", "16", "--prefix-tokens", "256,512",
           "--repeat", "1", "--flush-gb", "0.03", "--limit-gb", "0.0625"]


def test_figures_measure_each_ratio_against_the_same_runs_limits(tmp_path: Path, mem_dir: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    out = tmp_path / "figures.json"
    assert main([*FIGURES, "--paths", str(store), "--memory-paths", str(mem_dir), "--json", str(out)]) == 0
    assert not list(store.iterdir()) and not list(mem_dir.iterdir())  # every file of the run is gone
    report = json.loads(out.read_text())
    assert report["bench"] == "tiers-figures"
    lim = report["limits"]
    assert lim["memory_ref"]["name"] == "host memory copy" and lim["memory_ref"]["gbps"] > 0
    assert lim["storage_write_gbps"] > 0 and set(lim["storage_write_gbps_by_threads"]) == {"1", "4", "16"}
    hot = {(r["system"], r["prefix_tokens"]): r for r in report["hot_set"]}
    assert set(hot) == {(s, n) for s in ("tutti-mapped", "tutti-memory") for n in (256, 512)}
    assert all(r["store_gbps"] > 0 and r["retrieve_gbps"] > 0 for r in hot.values())
    # The mixed request: every even unit read from memory, every odd one from storage, each half
    # alone and both together, every byte checked (the run raises otherwise).
    (mixed,) = report["mixed"]
    assert mixed["prefix_tokens"] == 256 and mixed["units"] == 16
    assert min(mixed["t_memory_s"], mixed["t_storage_s"], mixed["t_mixed_s"]) > 0
    assert mixed["x_parts"] == pytest.approx((mixed["t_memory_s"] + mixed["t_storage_s"]) / mixed["t_mixed_s"], rel=1e-3)
    f = report["stores_during_flush"]
    units = (f["backlog_bytes"] + f["timed_bytes"]) // (128 << 10)
    assert f["flushes"] == units and f["flush_errors"] == 0 and f["flush_bytes"] >= f["backlog_bytes"] + f["timed_bytes"]
    assert f["flush_gbps"] > 0 and f["store_gbps"] > 0
    names = [r["figure"] for r in report["figures"]]
    assert names == ["hot set from memory"] * 2 + ["mixed request", "stores during a flush", "flush to storage"]
    by = {(r["figure"], r["prefix_tokens"]): r for r in report["figures"]}
    assert by[("hot set from memory", 512)]["ratio"] == pytest.approx(
        hot[("tutti-memory", 512)]["retrieve_gbps"] / lim["memory_ref"]["gbps"], rel=1e-3)
    assert by[("stores during a flush", 256)]["ratio"] == pytest.approx(
        f["store_gbps"] / hot[("tutti-mapped", 256)]["store_gbps"], rel=1e-3)
    assert f["write_gbps_flush_shaped"] > 0 and f["flush_request_bytes"] % (1 << 20) == 0
    limit = max(lim["storage_write_gbps"], f["write_gbps_flush_shaped"])
    assert by[("flush to storage", None)]["ratio"] == pytest.approx(f["flush_gbps"] / limit, rel=1e-3)
    assert {r["target"] for r in report["figures"]} == {0.90, 0.95}


def test_figures_refuse_bad_input(tmp_path: Path, mem_dir: Path) -> None:
    base = [*FIGURES, "--paths", str(tmp_path), "--memory-paths", str(mem_dir)]
    with pytest.raises(ConfigError, match="multiple of two units"):
        main([*base, "--prefix-tokens", "16"])
    with pytest.raises(ConfigError, match="--flush-gb"):
        main([*base, "--flush-gb", "0"])
    with pytest.raises(ConfigError, match="--repeat"):
        main([*base, "--repeat", "0"])
    assert not list(tmp_path.iterdir()) and not list(mem_dir.iterdir())


def test_bench_runs_the_memory_tier_system(tmp_path: Path, mem_dir: Path) -> None:
    from tutti_cluster.bench import main as bench_main

    store = tmp_path / "store"
    store.mkdir()
    out = tmp_path / "bench.json"
    base = ["--quick", "--device", "cpu", "--paths", str(store), "--prefix-tokens", "256", "--limit-gb", "0.0625"]
    with pytest.raises(ConfigError, match="tutti-memory needs a memory tier"):
        bench_main([*base, "--systems", "tutti-memory"])
    # With a memory tier configured it runs by default; every retrieve reads units that lie in memory.
    assert bench_main([*base, "--memory-paths", str(mem_dir), "--systems", "tutti,tutti-memory",
                       "--json", str(out)]) == 0
    got = {(r["system"], r["op"]) for r in json.loads(out.read_text())["results"]}
    assert got == {(s, op) for s in ("tutti", "tutti-memory") for op in ("store", "retrieve")}
    assert not list(store.iterdir()) and not list(mem_dir.iterdir())


def test_pipeline_with_the_memory_tier_runs_hot_and_cold(tmp_path: Path, mem_dir: Path) -> None:
    """The storage paths on tmpfs (a stand-in for NVMe): the store without a memory tier reads them
    as the one with a memory tier does, through io_uring, so that the cold run compares like with like."""
    from tutti_cluster.bench import main as bench_main

    store = mem_dir / "storage"
    mem_dir = mem_dir / "memory"
    store.mkdir()
    mem_dir.mkdir()
    (mem_dir / "tutti-bench-999999999").mkdir()  # a killed run's memory tier: removed by the next run
    out = tmp_path / "pipeline.json"
    assert bench_main(["--pipeline", "--device", "cpu", "--paths", str(store), "--memory-paths", str(mem_dir),
                       "--inputs", "1K", "--prefix-tokens", "50%", "--systems", "ideal,tutti", "--no-writeback",
                       "--decode-steps", "2", "--json", str(out)]) == 0
    assert not list(store.iterdir()) and not list(mem_dir.iterdir())
    report = json.loads(out.read_text())
    rows = {r["system"]: r for r in report["results"]}
    # Each restored the prefix bit for bit (the run raises otherwise), hot from memory, cold from storage.
    assert {"ideal", "tutti", "tutti-memory-hot", "tutti-memory-cold"} <= set(rows)
    assert all(rows[s]["matches_ideal"] == "bitwise" and rows[s]["itl_s"] > 0
               for s in ("tutti", "tutti-memory-hot", "tutti-memory-cold"))
    assert report["machine"]["memory_tier"]["memory_slots"] > 0
    assert report["machine"]["store"]["mapped_files"] == 0 and not report["machine"]["store"]["map_memory_paths"]
    (f,) = report["memory_tier"]
    assert f["input_tokens"] == 1024 and f["prefix_tokens"] == 512
    assert f["ttft_cold_x_off"] == pytest.approx(rows["tutti-memory-cold"]["ttft_s"] / rows["tutti"]["ttft_s"], rel=1e-2)
    assert f["ttft_hot_x_ideal"] == rows["tutti-memory-hot"]["x_ideal"] and "itl_cold_x_off" in f
    with pytest.raises(ConfigError, match="keep both in --systems"):
        bench_main(["--pipeline", "--device", "cpu", "--paths", str(store), "--memory-paths", str(mem_dir),
                    "--systems", "tutti"])

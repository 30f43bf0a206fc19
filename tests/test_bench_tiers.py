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
        with pytest.raises(ConfigError, match="tmpfs or ramfs"):
            main([*TINY, "--paths", str(tmp_path / "a"), "--memory-paths", str(tmp_path / "m")])


def test_the_hot_set_is_the_most_popular_prefixes_drawing_half_the_requests() -> None:
    w = zipf_weights(4, 1.0)  # 1, 1/2, 1/3, 1/4 over 25/12
    assert w.sum() == pytest.approx(1.0) and w[0] == pytest.approx(12 / 25)
    assert hot_prefixes(w) == 2  # 12/25 < 0.5 <= 18/25
    assert hot_prefixes(zipf_weights(10, 3.0)) == 1

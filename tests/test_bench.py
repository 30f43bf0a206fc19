"""Tests of ``tutti bench`` (tutti_cluster.bench): a real run on real files, its JSON schema, its
byte-exact verification, and its handling of bad input.  No figure is asserted on: speed belongs to
the benchmark, not to the tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the benchmark moves torch KV tensors")

from tutti_cluster.bench import fsutil, main  # noqa: E402
from tutti_cluster.bench.baselines import PerBlockBaseline, PerChunkBaseline  # noqa: E402
from tutti_cluster.bench.common import Round  # noqa: E402
from tutti_cluster.bench.errors import BenchVerificationError  # noqa: E402
from tutti_cluster.bench.kvdata import LLAMA3_8B, KVData  # noqa: E402
from tutti_cluster.errors import CapacityExceeded, ConfigError, DeviceError  # noqa: E402

RESULT_KEYS = {"system", "op", "prefix_tokens", "gbps", "cpu_us_per_layer"}
# Small enough for CI: 256 and 512 tokens are 16 and 32 blocks of the full Llama-3-8B shape.
TINY = ["--prefix-tokens", "256,512", "--limit-gb", "0.0625", "--baseline-threads", "4"]


def _run(tmp_path: Path, store_dir: Path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    before = set(store_dir.iterdir())
    rc = main(["--quick", "--device", "cpu", "--paths", str(store_dir), "--json", str(out), "--plot", str(png), *TINY, *extra])
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Everything the run created under the storage path is gone (a shared one, /dev/shm, may hold
    # other runs' directories).
    assert not [p for p in set(store_dir.iterdir()) - before if p.name.startswith("tutti-bench-")]
    return json.loads(out.read_text())


def _check_report(report: dict, systems: set[str]) -> None:
    assert set(report) == {"machine", "limits", "results"}
    m = report["machine"]
    for key in ("hostname", "cpu_model", "cores", "mem_bytes", "kernel", "paths", "date"):
        assert key in m, key
    assert all({"path", "fs_type", "direct_io"} <= set(p) for p in m["paths"])
    lim = report["limits"]
    assert set(lim) == {"storage_read_gbps", "storage_write_gbps"}  # no GPU: no h2d_gbps
    assert lim["storage_read_gbps"] > 0 and lim["storage_write_gbps"] > 0
    got = {(r["system"], r["op"], r["prefix_tokens"]) for r in report["results"]}
    want = {(s, op, n) for s in systems for op in ("store", "retrieve") for n in (256, 512)}
    assert got == want
    for r in report["results"]:
        assert RESULT_KEYS <= set(r)
        assert r["gbps"] > 0 and r["cpu_us_per_layer"] >= 0
        # Each retrieve was checked byte for byte against what was stored (the run raises otherwise).
        assert r["verified"] is True and r["bytes"] == r["prefix_tokens"] // 16 * LLAMA3_8B.block_bytes


def test_quick_run_on_disk_writes_the_json_schema(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    report = _run(tmp_path, store_dir)
    _check_report(report, {"tutti", "per-block", "per-chunk"})
    assert "kvikio" in report["machine"]["skipped"]  # CPU run: the reason is recorded


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this host")
def test_quick_run_on_tmpfs_with_the_mapped_store(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    before = set(shm.iterdir())
    report = _run(tmp_path, shm, "--systems", "tutti-mapped,per-block")
    _check_report(report, {"tutti-mapped", "per-block"})
    assert report["machine"]["paths"][0]["fs_type"] == "tmpfs"
    assert set(shm.iterdir()) <= before


def _round(kv: KVData, n: int) -> Round:
    return Round(n * 16, n, kv.place(n), kv.permutation(n), tag="t")


@pytest.mark.parametrize("cls", [PerBlockBaseline, PerChunkBaseline])
def test_baseline_round_trip_and_corruption_is_caught(tmp_path: Path, cls: type) -> None:
    kv = KVData(LLAMA3_8B, 32, torch.device("cpu"), seed=3)
    system = cls(kv, [tmp_path], 4)
    try:
        rnd = _round(kv, 32)
        system.prepare(rnd)
        system.store(rnd)
        kv.clear(32)
        system.before_read(rnd)
        system.retrieve(rnd)
        kv.verify(32, rnd.retrieve_ids, system.name)  # byte-exact: passes

        rnd = _round(kv, 32)
        system.store(rnd)
        # Flip one byte in the middle of one stored file: the read-back must be rejected.
        victim = sorted(tmp_path.iterdir())[1]
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2 + 5)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
        kv.clear(32)
        system.before_read(rnd)
        system.retrieve(rnd)
        with pytest.raises(BenchVerificationError):
            kv.verify(32, rnd.retrieve_ids, system.name)
    finally:
        system.close()
    assert not list(tmp_path.iterdir())


def test_verify_rejects_misplaced_and_missing_blocks() -> None:
    kv = KVData(LLAMA3_8B, 16, torch.device("cpu"), seed=1)
    ids = kv.place(16)
    kv.verify(16, ids, "x")
    swapped = ids.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    with pytest.raises(BenchVerificationError, match="logical block 0"):
        kv.verify(16, swapped, "x")
    ids = kv.place(16)
    kv.all[5, 1, int(ids[7])].zero_()  # one V object of one layer lost
    with pytest.raises(BenchVerificationError, match="layer 5"):
        kv.verify(16, ids, "x")


def test_bad_input_gets_clear_errors(tmp_path: Path) -> None:
    base = ["--quick", "--device", "cpu", "--paths", str(tmp_path)]
    with pytest.raises(ConfigError, match="multiple of 256"):
        main([*base, "--prefix-tokens", "1000"])
    with pytest.raises(ConfigError, match="token count"):
        main([*base, "--prefix-tokens", "lots"])
    with pytest.raises(ConfigError, match="unknown system"):
        main([*base, "--systems", "tutti,lmcache"])
    with pytest.raises(ConfigError, match="not a directory"):
        main(["--quick", "--paths", str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match="repeat"):
        main([*base, "--repeat", "0"])
    if fsutil.fs_type(tmp_path) not in fsutil.MEMORY_FS:
        with pytest.raises(ConfigError, match="memory file systems"):
            main([*base, "--systems", "tutti-mapped"])
    # 64M tokens are 8 TiB of KV: refused before anything is written.
    with pytest.raises(CapacityExceeded, match="needs"):
        main([*base, "--prefix-tokens", "64M"])
    assert not list(tmp_path.iterdir())
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError):
            main(["--quick", "--device", "cuda", "--paths", str(tmp_path)])


def test_leftovers_of_killed_runs_are_removed(tmp_path: Path) -> None:
    from tutti_cluster.bench.options import remove_stale_runs

    # A pid above the kernel's pid_max belongs to no process; our own pid is alive.
    dead = tmp_path / "tutti-bench-4194305"
    (dead / "tutti").mkdir(parents=True)
    (dead / "per-block-x-0.blk").write_bytes(b"x")
    alive = tmp_path / f"tutti-bench-{os.getpid()}"
    alive.mkdir()
    other = tmp_path / "tutti-bench-notes"
    other.mkdir()
    remove_stale_runs([tmp_path])
    assert not dead.exists() and alive.exists() and other.exists()

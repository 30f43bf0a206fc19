"""A tiny random-weight Llama model and a one-shot vLLM driver for the connector's end-to-end tests.

vLLM engines do not shut down cleanly inside one process, so every engine run is its own process::

    python tests/vllm_model.py make MODEL_DIR [SLIDING_WINDOW]
    python tests/vllm_model.py run MODEL_DIR OUT.json [KV_TRANSFER_CONFIG_JSON]

``run`` generates greedily for :func:`prompts` (requests sharing a long prefix, longer than
``max_num_batched_tokens`` so prefill is chunked) and writes the output token ids and vLLM's
prefix-cache metrics to ``OUT.json``. Nothing is downloaded: the model is made locally and the
prompts are token ids (``skip_tokenizer_init``).
"""

from __future__ import annotations

import glob
import json
import os
import random
import sys
import time
from typing import Any

BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
MAX_BATCHED_TOKENS = 256  # below the prompt length: chunked prefill
VOCAB = 1024
KV_HEADS, HEAD_DIM, LAYERS = 2, 32, 2


def make_model(path: str, sliding_window: int | None = None) -> None:
    """Saves a 2-layer Llama (hidden 128, 4 heads, 2 KV heads of 32) with seeded random weights; with
    ``sliding_window``, the same shape as a Mistral whose every layer attends to that window.
    ``VLLM_MODEL_WIDTH=HIDDEN,INTERMEDIATE`` widens its projections and MLP (the KV stays as it is),
    so that a prefill costs enough compute for a restore's TTFT to tell."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    hidden, intermediate = (int(x) for x in os.environ.get("VLLM_MODEL_WIDTH", "128,256").split(","))
    shape = dict(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096,
        tie_word_embeddings=False,
        # Weights drawn wider than Llama's default (0.02) so that attention is sharp: with the default a
        # random model this small attends nearly uniformly and its outputs hardly notice wrong K.
        initializer_range=0.15,
    )
    if sliding_window is None:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    else:
        model = MistralForCausalLM(MistralConfig(**shape, sliding_window=sliding_window))
    model.to(torch.float32).save_pretrained(path)


def prompts(n: int = 3, prefix_tokens: int = 600, suffix_tokens: int = 40, seed: int = 1,
            suffix_seed: int | None = None) -> list[list[int]]:
    """``n`` prompts sharing a ``prefix_tokens`` prefix, each with its own suffix (drawn after the
    prefix from ``seed``, or from ``suffix_seed``)."""
    r = random.Random(seed)
    prefix = [r.randrange(1, VOCAB) for _ in range(prefix_tokens)]
    rs = r if suffix_seed is None else random.Random(suffix_seed)
    return [prefix + [rs.randrange(1, VOCAB) for _ in range(suffix_tokens)] for _ in range(n)]


def run(model: str, out: str, kv_transfer_config: dict[str, Any] | None) -> None:
    """One engine, greedy; ``VLLM_MODEL_TP`` (default 1) sets the tensor-parallel size."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    tp = int(os.environ.get("VLLM_MODEL_TP", "1"))
    if tp > 1:
        # One core per CPU worker: vLLM cannot bind them automatically on a single NUMA node.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    slow = int(os.environ.get("VLLM_MODEL_SLOW_WRITES", "0"))
    if slow:
        # A fault: writes look slow (a store's `done` says no to its first `slow` polls of each
        # request), so they run on across several steps, as on a loaded device. Needs the worker
        # in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
        from tutti_cluster.store import TuttiStore

        polls: dict[tuple[int, int], int] = {}
        real_done = TuttiStore.done

        def slow_done(self: TuttiStore, req: int) -> bool:
            n = polls[(id(self), req)] = polls.get((id(self), req), 0) + 1
            return n > slow and real_done(self, req)

        TuttiStore.done = slow_done  # type: ignore[method-assign]
    blocks = os.environ.get("VLLM_MODEL_NUM_BLOCKS")  # a KV cache this small forces preemptions
    ngram = int(os.environ.get("VLLM_MODEL_NGRAM", "0"))  # speculative decoding: n-gram proposals
    speculative = ({"method": "ngram", "num_speculative_tokens": ngram, "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1} if ngram else None)
    llm = LLM(
        model=model, skip_tokenizer_init=True, block_size=BLOCK_SIZE, max_model_len=2048,
        max_num_batched_tokens=MAX_BATCHED_TOKENS, dtype="float32", enforce_eager=True,
        enable_prefix_caching=os.environ.get("VLLM_MODEL_PREFIX_CACHING", "1") == "1", disable_log_stats=False, seed=0, tensor_parallel_size=tp,
        kv_transfer_config=kv_transfer_config, num_gpu_blocks_override=int(blocks) if blocks else None,
        speculative_config=speculative,
    )
    plan = os.environ.get("VLLM_MODEL_PLAN")
    if plan:
        with open(plan) as f:
            outputs = run_plan(llm, json.load(f))
        with open(out, "w") as f:
            json.dump({"outputs": outputs, "metrics": _metrics(llm), "seconds": time.monotonic() - t0}, f)
        return
    # The first request ends with its prefill (one token): the connector must hold its blocks until
    # any save still reading them is done. The others decode on the shared prefix.
    shape = {"prefix_tokens": int(os.environ.get("VLLM_MODEL_PREFIX_TOKENS", "600")),
             "suffix_tokens": int(os.environ.get("VLLM_MODEL_SUFFIX_TOKENS", "40"))}
    first_seed = os.environ.get("VLLM_MODEL_SUFFIX_SEED")  # the first batch's suffixes: the same prefix
    batches = [prompts(**shape, suffix_seed=int(first_seed) if first_seed else None)]
    second = os.environ.get("VLLM_MODEL_SECOND_SUFFIX_SEED")  # a second batch: the same prefix, new suffixes
    if second:
        batches.append(prompts(**shape, suffix_seed=int(second)))
    outputs: list[list[int]] = []
    metrics_after: list[dict[str, float]] = []
    for ps in batches:
        params = [SamplingParams(temperature=0.0, max_tokens=1 if i == 0 else 8, detokenize=False)
                  for i in range(len(ps))]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params)
        outputs += [list(o.outputs[0].token_ids) for o in outs]
        drain(llm)
        metrics_after.append(_metrics(llm))
    # "metrics": the whole run; "metrics_after": after each batch (counters add up over batches).
    result = {"outputs": outputs, "metrics": metrics_after[-1], "metrics_after": metrics_after,
              "seconds": time.monotonic() - t0}
    with open(out, "w") as f:
        json.dump(result, f)


def _metrics(llm: Any) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            metrics[m.name] = metrics.get(m.name, 0) + value
    return metrics


def drain(llm: Any, timeout_s: float = 120.0) -> None:
    """Steps the engine until no finished request waits for the connector (its saves committed and
    counted). ``LLM.generate`` returns once every output is final, while vLLM's own engine loop
    steps on until then; the metrics read right after would miss the last saves on a slow host. An
    engine in its own process (multiprocessing) runs that loop by itself: nothing to do here."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0", "no in-process scheduler found to drain"
        return
    deadline = time.monotonic() + timeout_s
    while scheduler.has_requests():
        if time.monotonic() > deadline:
            raise RuntimeError(f"requests still wait for the connector after {timeout_s:.0f} s")
        llm.llm_engine.step()


def run_plan(llm: Any, plan: list[list[dict[str, Any]]]) -> dict[str, list[int]]:
    """Steps the engine by hand (``VLLM_MODEL_PLAN``): before engine step *i* the entries of
    ``plan[i]`` are applied (``{"id", "prompt", "max_tokens"}`` adds a request, ``{"abort": id}``
    aborts one), then it steps until all are done; returns each finished request's greedy tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine, outputs = llm.llm_engine, {}

    def step() -> None:
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)

    for adds in plan:
        for r in adds:
            if "abort" in r:
                engine.abort_request([r["abort"]])
                continue
            engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]),
                               SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], detokenize=False))
        step()
    while engine.has_unfinished_requests():
        step()
    drain(llm)
    return outputs


def kv_transfer_config(unit_tokens: int, **extra: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for the TuttiConnector with a small pool; ``extra`` goes into
    the store's config (``kv_connector_extra_config``)."""
    return {
        "kv_connector": "TuttiConnector",
        "kv_connector_module_path": "tutti_cluster.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"capacity_gb": 0.05, "unit_tokens": unit_tokens, **extra},
    }


def run_engine(model: Any, out: Any, kv_config: dict[str, Any] | None, *, timeout: float,
               drop: tuple[str, ...] = (), **env: str) -> dict[str, Any]:
    """``run`` in a fresh process, without the caller's ``TUTTI_*`` variables and those in ``drop``,
    with ``env`` added; returns what it wrote, or raises AssertionError with its output."""
    import subprocess

    child = {k: v for k, v in os.environ.items() if not k.startswith("TUTTI_") and k not in drop}
    child.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0", **env)
    cmd = [sys.executable, os.path.abspath(__file__), "run", str(model), str(out)]
    if kv_config is not None:
        cmd.append(json.dumps(kv_config))
    proc = subprocess.run(cmd, env=child, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        raise AssertionError(f"engine run failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    with open(out) as f:
        return json.load(f)


def _open_pool(path: Any, instance: str, unit_tokens: int, tp: int) -> Any:
    """Opens a rank's pool read-only with the descriptors the connector builds for this model."""
    import torch

    from tutti_cluster import TuttiConfig, TuttiStore
    from tutti_cluster.vllm import layer_kv_from_vllm

    # vLLM's per-layer view on the CPU backend: [blocks, kv heads of the rank, block tokens, K|V].
    layer = layer_kv_from_vllm(torch.zeros(1, KV_HEADS // tp, BLOCK_SIZE, 2 * HEAD_DIM), 1)
    store = TuttiStore(TuttiConfig(paths=[path], unit_tokens=unit_tokens, instance=instance))
    store.register_kv_caches([layer] * LAYERS, block_tokens=BLOCK_SIZE, read_only=True)
    return store


def units_in_pool(path: Any, unit_tokens: int, rank: int = 0, tp: int = 1) -> int:
    """Units committed in rank ``rank``'s pool under ``path``."""
    store = _open_pool(path, f"default-r{rank}", unit_tokens, tp)
    try:
        return len(store.keys())
    finally:
        store.close()


def corrupt_pool(path: Any, unit_tokens: int, rank: int = 0, tp: int = 1, scramble: bool = False) -> int:
    """Flips one byte inside the last layer's object of every slot of a rank's pool (``scramble``:
    overwrites every object with random bytes instead); headers stay valid, so lookups still find
    the units. Returns how many units were committed there."""
    store = _open_pool(path, f"default-r{rank}", unit_tokens, tp)
    try:
        g, present = store.geometry(), len(store.keys())
    finally:
        store.close()
    # A path may hold several pool files (tutti-<instance>.pool, tutti-<instance>.<k>.pool), each a
    # run of GPU-file slots with the header first.
    pools = glob.glob(os.path.join(str(path), f"tutti-default-r{rank}.pool"))
    pools += glob.glob(os.path.join(str(path), f"tutti-default-r{rank}.*.pool"))
    for pool in pools:
        slots = os.path.getsize(pool) // g["slot_bytes"]
        with open(pool, "r+b") as f:
            for slot in range(slots):
                if scramble:
                    f.seek(slot * g["slot_bytes"] + g["header_bytes"])
                    f.write(os.urandom(g["slot_bytes"] - g["header_bytes"]))
                    continue
                off = slot * g["slot_bytes"] + g["header_bytes"] + (LAYERS - 1) * g["obj_bytes"] + 123
                f.seek(off)
                byte = f.read(1)
                f.seek(off)
                f.write(bytes([byte[0] ^ 0xFF]))
    return present


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "make":
        make_model(argv[1], int(argv[2]) if len(argv) > 2 else None)
    elif len(argv) >= 3 and argv[0] == "run":
        run(argv[1], argv[2], json.loads(argv[3]) if len(argv) > 3 else None)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])

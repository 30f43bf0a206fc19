"""Diagnostic: one engine run of ``tutti bench vllm`` (a spec it wrote, kept with ``--paths``) with a
timeline of the connector's calls and of the engine's own steps, to see where a restore's time to
first token goes; and the phases of the timed request's first forward step, from such timelines.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python tools/diag/vllm_restore_timeline.py RUNS/tutti256-restore0.spec.json /tmp/out.json /tmp/timeline.txt
    python tools/diag/vllm_restore_timeline.py --summary /tmp/timeline*.txt

Each probe appends ``<seconds since generate> <event>`` to the timeline file (the engine run ends
with ``os._exit``, so nothing is kept in memory; each note costs some 10-30 us). Besides the
connector's hooks and the store's calls, vLLM's engine step, scheduler, model runner and each Llama
decoder layer are probed, so a ``cached`` spec (no connector) gives the same phases to compare.

``--summary`` prints, per timeline and as medians, the phases (ms) of the step that runs the timed
request's first forward (the last ``generate`` of the file): ``pre`` (generate to the first
schedule: the front end's input processing), ``steps`` (steps before that one: 1 when the load is
asynchronous), ``to_fwd`` (that step's schedule to its forward: scheduling, the model runner's
preparation, ``start_load_kv``), ``layer0`` and ``layers1+`` (the decoder layers), ``post`` (the
forward's end to the step's end: logits, ``wait_for_save``, sampling, output), ``first_step_end``,
``connector`` (time inside the connector's hooks up to then, nested calls counted once) and
``load_wait`` (inside ``wait_for_layer_load``). Not part of the suite.
"""

from __future__ import annotations

import functools
import re
import statistics
import sys
import time
from typing import Any, Callable

T0 = [0.0]


def main(spec: str, out: str, timeline: str) -> None:
    import vllm
    from vllm.model_executor.models.llama import LlamaDecoderLayer
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from tutti_cluster.bench.vllm_restore import child_run
    from tutti_cluster.store import TuttiStore
    from tutti_cluster.vllm.scheduler import TuttiScheduler
    from tutti_cluster.vllm.worker import TuttiWorker

    def note(what: str) -> None:
        with open(timeline, "a") as f:
            f.write(f"{time.monotonic() - T0[0]:9.4f} {what}\n")

    def probe(cls: Any, name: str, label: Callable[[tuple[Any, ...]], str] = lambda a: "") -> None:
        fn = getattr(cls, name)

        @functools.wraps(fn)
        def wrapped(*a: Any, **k: Any) -> Any:
            tag = f"{cls.__name__}.{name}{label(a)}"
            note(f"> {tag}")
            try:
                return fn(*a, **k)
            finally:
                note(f"< {tag}")

        setattr(cls, name, wrapped)

    gen = vllm.LLM.generate

    def generate(self: Any, *a: Any, **k: Any) -> Any:
        T0[0] = time.monotonic()
        note("> generate")
        try:
            return gen(self, *a, **k)
        finally:
            note("< generate")

    vllm.LLM.generate = generate  # type: ignore[method-assign]
    for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "update_connector_output", "request_finished", "take_stats"):
        probe(TuttiScheduler, name)
    for name in ("start_load_kv", "_finish_loads", "get_finished", "wait_for_save", "before_step", "take_stats",
                 "save_kv_layer", "get_block_ids_with_load_errors", "build_connector_worker_meta"):
        probe(TuttiWorker, name)
    probe(TuttiWorker, "wait_for_layer_load", lambda a: f"({a[1]})")
    for name in ("begin_retrieve", "retrieve_layer", "finish", "stats", "done"):
        probe(TuttiStore, name)
    # The engine's own steps, in both systems (``cached`` has no connector calls to show).
    probe(EngineCore, "step")
    for name in ("schedule", "update_from_output"):
        probe(Scheduler, name)
    for name in ("execute_model", "sample_tokens", "_model_forward", "_update_states", "_prepare_inputs",
                 "_build_attention_metadata", "_preprocess"):
        probe(GPUModelRunner, name)
    probe(LlamaDecoderLayer, "forward", lambda a: f"({a[0].self_attn.attn.layer_name.split('.')[2]})")
    child_run(spec, out)


def phases(path: str) -> dict[str, float]:
    """The phases (ms) of the step that runs the first forward of a timeline's last ``generate``."""
    with open(path) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip() and not ln.startswith("#")]
    start = max(i for i, ln in enumerate(lines) if ln.split(None, 1)[1] == "> generate")
    events = [(float(t), e) for t, e in (ln.split(None, 1) for ln in lines[start:])]

    def at(what: str, after: float = -1.0) -> float:
        return next(t for t, e in events if t >= after and e == what)

    fwd = at("> GPUModelRunner._model_forward")
    step = max(t for t, e in events if e == "> EngineCore.step" and t <= fwd)
    sched = at("> Scheduler.schedule", step)
    end = at("< EngineCore.step", fwd)
    layer0 = at("< LlamaDecoderLayer.forward(0)", fwd)
    fwd_end = at("< GPUModelRunner._model_forward", fwd)
    steps = sum(1 for t, e in events if e == "> EngineCore.step" and t < step)
    inside = {"connector": 0.0, "load_wait": 0.0}
    depth, since = 0, 0.0
    for t, e in events:
        if t > end:
            break
        m = re.match(r"([<>]) Tutti(Scheduler|Worker)\.(\w+)", e)
        if not m:
            continue
        if m.group(1) == ">":
            depth += 1
            if depth == 1:
                since = t
        else:
            depth -= 1
            if depth == 0:
                inside["connector"] += t - since
                if m.group(3) == "wait_for_layer_load":
                    inside["load_wait"] += t - since
    return {"pre": sched * 1e3 if steps == 0 else at("> Scheduler.schedule") * 1e3, "steps": steps,
            "to_fwd": (fwd - sched) * 1e3, "layer0": (layer0 - fwd) * 1e3, "layers1+": (fwd_end - layer0) * 1e3,
            "post": (end - fwd_end) * 1e3, "first_step_end": end * 1e3,
            "connector": inside["connector"] * 1e3, "load_wait": inside["load_wait"] * 1e3}


def summary(paths: list[str]) -> None:
    rows = [phases(p) for p in paths]
    for p, r in zip(paths, rows):
        print(f"{p}: " + " ".join(f"{k} {v:.1f}" for k, v in r.items()))
    if len(rows) > 1:
        print("median: " + " ".join(f"{k} {statistics.median(r[k] for r in rows):.1f}" for k in rows[0]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summary"]:
        summary(sys.argv[2:])
    else:
        main(*sys.argv[1:4])

"""Diagnostic: one engine run of ``tutti bench vllm`` (a spec it wrote, kept with ``--paths``) with a
timeline of the connector's calls, to see where a restore's time to first token goes.

    python tools/diag/vllm_restore_timeline.py RUNS/tutti256-restore0.spec.json /tmp/out.json /tmp/timeline.txt

Each probe appends ``<seconds since generate> <event>`` to the timeline file (the engine run ends
with ``os._exit``, so nothing is kept in memory). Not part of the suite.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable

T0 = [0.0]


def main(spec: str, out: str, timeline: str) -> None:
    import vllm

    from tutti_cluster.bench.vllm_restore import child_run
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
                 "update_connector_output", "request_finished"):
        probe(TuttiScheduler, name)
    for name in ("start_load_kv", "_finish_loads", "get_finished", "wait_for_save", "before_step"):
        probe(TuttiWorker, name)
    probe(TuttiWorker, "wait_for_layer_load", lambda a: f"({a[1]})")
    child_run(spec, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])

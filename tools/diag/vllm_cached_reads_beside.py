"""Diagnostic: the bench's system ``cached`` (vLLM's own prefix cache, the engine's second request),
optionally with 260 MiB of O_DIRECT reads by four ``dd`` processes started as the timed request
starts: what plain disk reads beside the forward cost the engine, with none of the store's code
running. Give it a ``cached`` spec that ``tutti bench vllm --keep`` wrote and, for the reads, a file
of at least 260 MiB on the store's disk (the run's pool file). Not part of the suite.

    python tools/diag/vllm_cached_reads_beside.py RUNS/cached-run0.spec.json /tmp/out.json [FILE]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any


def main(spec: str, out: str, path: str | None) -> None:
    import vllm

    from tutti_cluster.bench.vllm_restore import child_run

    gen = vllm.LLM.generate
    calls = [0]
    with open(spec) as f:
        s = json.load(f)
    timed = 1 + bool(s.get("warm_up")) + bool(s.get("warm_first"))  # child_run's requests, in order

    def generate(self: Any, *a: Any, **k: Any) -> Any:
        calls[0] += 1
        procs = []
        t0 = time.monotonic()
        if calls[0] == timed and path:
            procs = [subprocess.Popen(["dd", f"if={path}", "of=/dev/null", "bs=1M", "count=65", f"skip={i * 65}",
                                       "iflag=direct", "status=none"]) for i in range(4)]
        try:
            return gen(self, *a, **k)
        finally:
            for p in procs:
                p.wait()
            if procs:
                print(f"reads done {time.monotonic() - t0:.3f} s after the request started", file=sys.stderr)

    vllm.LLM.generate = generate  # type: ignore[method-assign]
    child_run(spec, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)

"""``tutti bench``: tutti's retrieve and store bandwidth and host CPU per layer call for the
Llama-3-8B KV shape, beside the per-block and per-chunk baselines (and kvikio on CUDA) and the
storage and host-to-GPU limits measured in the same run.  See docs/BENCH.md.

Every benchmark lives in this package: ``tutti bench`` (``runner``, its flags in ``args``),
``tutti bench --pipeline`` (``pipeline``, over the model-shaped prefill of ``prefill``),
``tutti profile`` (``prefill.profile``), ``tutti bench cluster`` (``cluster``), ``tutti bench
tiers`` (``tiers``: the memory tier against one tier of the same capacity) and ``tutti bench vllm``
(``vllm_restore``). The runtime (store, node daemon, cluster, vLLM connector, admin plane)
imports none of it; the ``tutti`` command imports a benchmark when it runs one. ``tutti bench``,
``tutti bench tiers`` and ``tutti profile`` need the ``bench`` extra (:mod:`.extra`)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tutti bench`` (imports PyTorch; the flags alone are in ``bench.args``)."""
    from tutti_cluster.bench.runner import main as run_main

    return run_main(argv)


__all__ = ["main"]

"""The layer-wise prefill that ``tutti bench --pipeline`` measures: a model-shaped decoder over a
paged KV cache (``model``), the harness that restores a prefix from a
:class:`~tutti_cluster.TuttiStore` layer by layer while the suffix is computed, beside the systems it
is judged against (``harness``), and ``tutti profile``, the offline profiler of the scheduler's idle
windows (``profile``). The scheduler itself is runtime: :mod:`tutti_cluster.pipeline`. See
docs/BENCH.md, "Pipeline"."""

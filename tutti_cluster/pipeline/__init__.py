"""The layer-wise prefill pipeline: a model-shaped decoder over a paged KV cache (``model``), the
harness that restores a prefix from a :class:`~tutti_cluster.TuttiStore` layer by layer while the
suffix is computed (``harness``), the slack-aware I/O scheduler (``scheduler``) and the offline
profiler of idle windows (``profile``). See docs/BENCH.md, "Pipeline"."""

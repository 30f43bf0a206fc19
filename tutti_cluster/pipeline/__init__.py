"""The slack-aware I/O of a layer-wise prefill: the calls a prefill makes around each layer
(``hooks``), the scheduler that places a request's prefix reads and new KV's writes in the layers'
idle windows (``scheduler``, used by the vLLM worker) and the table of those windows from an offline
profile (``table``). The model-shaped decoder, harness and profiler that measure it are benchmarks:
:mod:`tutti_cluster.bench.prefill`. See docs/BENCH.md, "Pipeline"."""

"""The flags of ``tutti bench``, importable without PyTorch (``tutti bench --help`` needs none)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tutti_cluster.config import add_config_arguments

SYSTEMS = ("tutti", "tutti-mapped", "tutti-memory", "per-block", "per-chunk", "kvikio")
MODEL_SHAPES = ("llama3-8b", "glm4-9b-1m", "tiny")
# The store settings a bench run takes from the command line; the others (cluster, admin) play no
# part in it, and the device is --device's.
BENCH_CONFIG_FIELDS = ("paths", "capacity_gb", "data_dir", "direct_io", "pool_files", "prewrite_pool",
                       "map_memory_paths", "unit_tokens", "min_io_bytes", "queue_depth", "iocb_depth", "staging_mb",
                       "max_requests", "io_sms", "cuda_pair", "cuda_trace", "copy_engine_mb", "memory_paths",
                       "memory_capacity_gb")


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser_class(
        prog="tutti bench",
        description="Retrieve/store bandwidth and host CPU per layer call of tutti, beside the per-block "
        "(vLLM file offload) and per-chunk (LMCache disk) baselines and the same-run storage limits, "
        "for the Llama-3-8B KV shape. Needs PyTorch (pip install torch) and the bench extra "
        "(pip install 'tutti-cluster[bench]'). The cluster benchmark: "
        "tutti bench cluster --help.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks on errors")
    p.add_argument("--quick", action="store_true", help="small prefixes (4K,16K), one round: under a minute")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG plot")
    p.add_argument("--prefix-tokens", nargs="+", metavar="N", help="prefix lengths, e.g. 16K,32K,64K,128K")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--drop-caches", action="store_true",
                   help="also sync and drop the kernel's page cache before each read pass (needs root)")
    p.add_argument("--systems", nargs="+", metavar="NAME", help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--repeat", type=int, metavar="N", help="rounds per prefix and system (default 1)")
    p.add_argument("--baseline-threads", type=int, default=16, metavar="N", help="baselines' thread pools")
    p.add_argument("--limit-gb", type=float, metavar="GB",
                   help="bytes for the storage-limit files (default 4, --quick 0.5)")
    p.add_argument("--limit-buffer-mb", type=int, metavar="MB",
                   help="host buffer the storage-limit reads land in (default: the store's staging area)")
    p.add_argument("--seed", type=int, default=0)
    _pipeline_arguments(p)
    add_config_arguments(p, BENCH_CONFIG_FIELDS,
                         default_notes={"capacity_gb": "sized to the prefix", "memory_capacity_gb": "sized to the prefix",
                                        "memory_paths": "none; the tutti-memory system and --pipeline's memory-tier "
                                        "runs need them"})
    return p


def _pipeline_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "pipeline (--pipeline)",
        "TTFT of a model-shaped prefill whose prefix is restored layer by layer while the suffix is computed, "
        "against the HBM ideal, a naive per-layer pipeline, load-then-compute, the per-chunk baseline and "
        "full recompute (docs/BENCH.md, Pipeline). --prefix-tokens, --systems, --repeat, --json, --plot, "
        "--device and the store flags apply to it too.")
    g.add_argument("--pipeline", action="store_true", help="run the pipeline benchmark instead of bandwidth")
    g.add_argument("--model", choices=MODEL_SHAPES, help="model shape [default: tiny on --device cpu, else llama3-8b]")
    g.add_argument("--model-layers", type=int, metavar="N", help="override the shape's layer count")
    g.add_argument("--inputs", nargs="+", metavar="N",
                   help="input lengths [default: 64K,128K; on the CPU 1K,2K]. Prefixes (--prefix-tokens) are "
                   "tokens (16K), shares of the input (75%%) or -1u (the input minus one unit) [default: "
                   "16K,32K,64K,96K,-1u; on the CPU 25%%,50%%,75%%,-1u]; those not shorter than an input are "
                   "skipped for it")
    g.add_argument("--attention", choices=("auto", "flex", "sdpa", "split"), default="auto",
                   help="attention kernel: auto is flex_attention for a cached prefix on CUDA, SDPA otherwise; split is "
                   "two flash-attention calls (suffix over prefix, suffix over itself) merged by log-sum-exp")
    g.add_argument("--flex-compile", choices=("auto", "static"), default="auto",
                   help="flex_attention compile: static compiles every (input, prefix) shape; auto lets torch "
                   "switch to symbolic lengths at the second shape (fewer compiles)")
    g.add_argument("--naive-ahead", type=int, default=0, metavar="N",
                   help="naive and per-chunk: issue reads N layers ahead of the compute (0: every layer up front)")
    g.add_argument("--read-ahead", type=int, default=2, metavar="N",
                   help="scheduler: reads that fill a layer's slack reach at most N layers ahead [default: 2; 0: as "
                   "far as the window holds] (docs/BENCH.md says why)")
    g.add_argument("--iocb-ioctx", type=int, default=1024, metavar="N",
                   help="scheduler: IOCTXs per read IOCB (1..2048), the granularity reads fill windows with")
    g.add_argument("--tutti-reads", choices=("auto", "iocb", "layer"), default="auto",
                   help="scheduler's reads: raw IOCBs (get_iocb/fill_iocb/issue_io/wait_cqe, the host waits) or "
                   "whole layers (retrieve_layer/wait_layer, stream-ordered on CUDA); auto: layer on CUDA, iocb on the CPU")
    g.add_argument("--compute-on", choices=("partition", "device"), default="partition",
                   help="CUDA: every system's compute on the store's compute stream (the SMs outside the I/O "
                   "partition, where green contexts give one) or on a stream of the whole device")
    g.add_argument("--writeback", action=argparse.BooleanOptionalAction, default=True,
                   help="also run tutti writing the suffix's new KV back (scheduled into slack, flushed in decode)")
    g.add_argument("--decode-steps", type=int, metavar="N",
                   help="decode steps timed for inter-token latency [default: 16; on the CPU 4]")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: N processes, one GPU each, each with its share of the heads and "
                   "the MLP and its own store (own queues, own share of the paths: every N-th path, or a "
                   "rank<r> directory in each) [default: 1]")
    g.add_argument("--tp-backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="the model's collectives under --tp: auto is NCCL on CUDA, gloo on the CPU; gloo on "
                   "CUDA lets ranks share a GPU (testing only: their timings are not a TP run's)")
    g.add_argument("--profile", type=Path, metavar="PATH",
                   help="slack windows from `tutti profile`'s file [default: the resident run's per-layer times]")
    g.add_argument("--output-tokens", type=int, default=512, metavar="N",
                   help="cost model: tokens generated per request")
    g.add_argument("--gpu-price-hour", type=float, default=3.50, metavar="USD", help="cost model: one GPU-hour")
    g.add_argument("--dram-price-gb-hour", type=float, default=0.004, metavar="USD",
                   help="cost model: one GB of host memory for an hour")
    g.add_argument("--ssd-price-gb-hour", type=float, default=0.0001, metavar="USD",
                   help="cost model: one GB of NVMe for an hour")

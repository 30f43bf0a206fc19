"""The flags of ``tutti bench``, importable without PyTorch (``tutti bench --help`` needs none)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tutti_cluster.config import add_config_arguments

SYSTEMS = ("tutti", "tutti-mapped", "per-block", "per-chunk", "kvikio")
# The store settings a bench run takes from the command line; the others (cluster, admin) play no
# part in it, and the device is --device's.
BENCH_CONFIG_FIELDS = ("paths", "capacity_gb", "data_dir", "direct_io", "pool_files", "prewrite_pool",
                       "map_memory_paths", "unit_tokens", "min_io_bytes", "queue_depth", "iocb_depth", "staging_mb",
                       "max_requests", "io_sms", "cuda_pair", "cuda_trace")


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser_class(
        prog="tutti bench",
        description="Retrieve/store bandwidth and host CPU per layer call of tutti, beside the per-block "
        "(vLLM file offload) and per-chunk (LMCache disk) baselines and the same-run storage limits, "
        "for the Llama-3-8B KV shape. Needs PyTorch (pip install torch). The cluster benchmark: "
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
    add_config_arguments(p, BENCH_CONFIG_FIELDS,
                         default_notes={"capacity_gb": "sized to the prefix"})
    return p

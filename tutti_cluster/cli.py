"""The `tutti` command: `tutti up` (node daemon, or its demo) and `tutti bench`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tutti_cluster.config import TuttiConfig, load_config
from tutti_cluster.errors import TuttiError

log = logging.getLogger("tutti")


def _config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("store (each also TUTTI_<NAME> in the environment)")
    g.add_argument("--paths", help="comma-separated storage directories, one per SSD")
    g.add_argument("--capacity-gb", help="GiB per path (one value, or one per path, comma-separated)")
    g.add_argument("--data-dir", help="node state directory (default ~/.local/share/tutti)")
    g.add_argument("--unit-tokens", type=int, help="tokens per cache unit")
    g.add_argument("--instance", help="name of this process's pool share")
    c = p.add_argument_group("cluster (all unset: single node)")
    c.add_argument("--etcd", help="etcd endpoints host:port[,host:port]")
    c.add_argument("--mooncake-master", help="Mooncake master host:port")
    c.add_argument("--node-id", help="this node's name in the cluster")
    c.add_argument("--protocol", choices=["tcp", "rdma"], help="Transfer Engine protocol")
    c.add_argument("--lease-ttl-s", type=int, help="TTL of replica registrations")


def config_from_args(a: argparse.Namespace, **extra: Any) -> TuttiConfig:
    keys = ["paths", "capacity_gb", "data_dir", "unit_tokens", "instance", "etcd", "mooncake_master", "node_id",
            "protocol", "lease_ttl_s", "admin_host", "admin_port"]
    args = {k: getattr(a, k, None) for k in keys}
    args.update({k: v for k, v in extra.items() if v is not None})
    return load_config(**args)


def cmd_up(a: argparse.Namespace) -> int:
    if a.demo:
        from tutti_cluster.demo import run_demo

        cfg = config_from_args(a, instance=a.instance or "demo",
                               capacity_gb=a.capacity_gb or str(max(1.0, a.tokens / 4096)))
        r = run_demo(cfg, prefix_tokens=a.tokens)
        print(f"Tutti demo: Llama-3-8B shape, {r.prefix_tokens} tokens, store at {', '.join(map(str, cfg.storage_paths()))}"
              f" ({'O_DIRECT' if r.direct_io else 'buffered I/O'})")
        print(f"  hit rate      {r.hit_rate * 100:6.1f} %")
        print(f"  store         {r.store_gbps:6.2f} GB/s")
        print(f"  retrieve      {r.retrieve_gbps:6.2f} GB/s")
        print(f"  byte-exact    {'yes' if r.exact else 'NO'}")
        return 0 if r.exact and r.hit_rate == 1.0 else 1
    from tutti_cluster.daemon import run_daemon

    cfg = config_from_args(a)
    admin = _admin_plane(cfg)

    def ready(_: Any) -> None:
        mode = "cluster" if cfg.cluster_mode else "single node (embedded default)"
        print(f"tutti node daemon serving: {mode}; data {cfg.data_dir}; paths "
              f"{', '.join(map(str, cfg.storage_paths()))}. Ctrl-C stops it.", flush=True)
        if admin is not None:
            admin.start()
            print(f"tutti admin API on http://{admin.address}; token: {admin.token_note}", flush=True)

    try:
        run_daemon(cfg, ready=ready, advertise={"admin": admin.advertised} if admin is not None else None)
    finally:
        if admin is not None:
            admin.stop()
    return 0


def _admin_plane(cfg: TuttiConfig) -> Any:
    """The node's admin API (tutti_control, imported only here), bound but not started; None, with
    a warning, where the admin extra is not installed."""
    try:
        from tutti_control.serve import NodeAdmin

        return NodeAdmin(cfg)
    except ImportError as e:
        log.warning("admin API not served (%s): pip install 'tutti-cluster[admin]'", e)
        return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tutti`` console script: a TuttiError is one line on stderr, status 2."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _dispatch(argv)
    except TuttiError as e:
        print(f"tutti: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(argv: list[str]) -> int:
    if argv[:2] == ["bench", "cluster"]:  # the benchmarks own their flags
        from tutti_cluster.cluster.bench import main as cluster_bench_main

        return int(cluster_bench_main(argv[2:]) or 0)
    if argv[:1] == ["admin"]:  # the admin client owns its flags; FastAPI is never imported for it
        try:
            from tutti_control.cli import main as admin_main
        except ImportError as e:
            print(f"tutti admin needs the admin extra ({e}): pip install 'tutti-cluster[admin]'", file=sys.stderr)
            return 2
        return int(admin_main(argv[1:]) or 0)
    if argv[:1] == ["bench"]:
        try:
            from tutti_cluster.bench import main as bench_main
        except ImportError as e:  # the benchmark's KV tensors are torch tensors
            print(f"tutti bench needs PyTorch ({e}): pip install torch", file=sys.stderr)
            return 2
        return int(bench_main(argv[1:]) or 0)
    p = argparse.ArgumentParser(prog="tutti", description="Tutti-cluster: SSD-backed KV-cache store.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="run the node daemon (or --demo)")
    _config_args(up)
    up.add_argument("--demo", action="store_true", help="push a synthetic Llama-3-8B prefix through the store and exit")
    up.add_argument("--tokens", type=int, default=8192, help="demo prefix length in tokens")
    adm = up.add_argument_group("admin API (docs/ADMIN.md)")
    adm.add_argument("--admin-host", help="address of the node's admin API (TUTTI_ADMIN_HOST, default 127.0.0.1)")
    adm.add_argument("--admin-port", type=int, help="port of the node's admin API (TUTTI_ADMIN_PORT, default 9480)")
    sub.add_parser("admin", help="admin plane client: status, stats, objects, evict, pin, unpin, drain; and "
                   "serve, the cluster-wide admin API (tutti admin --help)")
    sub.add_parser("bench", help="benchmark against baselines and same-run limits (tutti bench --help); "
                   "`tutti bench cluster` measures remote fetch and lookups (tutti bench cluster --help)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return cmd_up(a)


if __name__ == "__main__":
    sys.exit(main())

"""The `tutti` command: `tutti up` (the node daemon, or its demo), `tutti bench`, `tutti profile`,
`tutti admin`.

Every command's store flags are generated from :class:`~tutti_cluster.config.TuttiConfig`
(:func:`~tutti_cluster.config.add_config_arguments`), so a flag, its ``TUTTI_*`` variable and its
field are one declaration. ``--help`` of every command works without the optional dependencies
(PyTorch, FastAPI, httpx, Mooncake); running a command that needs one says which, in one line.
Errors are one line, ``tutti: error: ...``, status 2 (the admin client's API errors 1, an
unreachable API 3); ``-v`` adds debug logging and the traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import Any, NoReturn

from tutti_cluster.config import TuttiConfig, add_config_arguments, config_arguments, load_config
from tutti_cluster.errors import TuttiError

log = logging.getLogger("tutti")

DEMO_TOKENS = 8192

COMMANDS = (
    ("up", "run the node daemon: owns the storage paths, hands each engine its share, serves the admin API "
           "(and, with --etcd, this node's units to other nodes); --demo: try the store once and exit"),
    ("bench", "bandwidth against baselines and the same-run storage limits (needs PyTorch and the bench extra); "
              "`tutti bench cluster`: remote fetch and directory lookups (needs the cluster extra); "
              "`tutti bench tiers`: a skewed workload through the memory and storage tiers against one tier of the "
              "same capacity; `tutti bench vllm`: a real vLLM engine's restore TTFT against recompute (needs vLLM)"),
    ("profile", "offline profile of a model shape's per-layer compute on an (input, prefix) grid: the slack "
                "windows `tutti bench --pipeline --profile` schedules I/O into (needs PyTorch and the bench extra)"),
    ("cluster-key", "write a new cluster credential (64 random hex digits, mode 0600) to PATH, for "
                    "--cluster-secret-file on every node and engine of a cluster"),
    ("admin", "admin plane client: status, stats, objects, evict, pin, unpin, drain; serve: the cluster-wide "
              "admin API (needs the admin extra)"),
)

# Which extra brings which optional module, for the one-line error when it is missing.
_EXTRAS = {"torch": "torch", "fastapi": "admin", "uvicorn": "admin", "httpx": "admin", "prometheus_client": "admin",
           "mooncake": "cluster", "grpc": "cluster", "etcd3": "cluster", "vllm": "vllm", "tqdm": "bench",
           "matplotlib": "bench"}


def install_hint(extra: str) -> str:
    """The command that installs an extra, in the form that fits how this package was installed:
    from the package index (``pip install 'tutti-cluster[admin]'``), from a source tree
    (``pip install -e '/src/tutti[admin]'``, editable or not as it was), or not at all (run from a
    checkout: ``pip install -e '<root>[admin]'``). ``torch`` is no extra: ``pip install torch``."""
    if extra == "torch":
        return "pip install torch"
    import json
    from importlib import metadata
    from pathlib import Path
    from urllib.parse import unquote, urlparse

    try:
        dist = metadata.distribution("tutti-cluster")
    except metadata.PackageNotFoundError:
        root = Path(__file__).resolve().parent.parent
        return f"pip install -e '{root}[{extra}]'" if (root / "pyproject.toml").exists() else \
            f"pip install 'tutti-cluster[{extra}]'"
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "null")
    except ValueError:
        direct = None
    if isinstance(direct, dict) and str(direct.get("url", "")).startswith("file://"):
        src = unquote(urlparse(direct["url"]).path)
        editable = bool((direct.get("dir_info") or {}).get("editable"))
        return f"pip install {'-e ' if editable else ''}'{src}[{extra}]'"
    return f"pip install 'tutti-cluster[{extra}]'"


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one ``tutti: error:`` line (and a pointer to ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"tutti: error: {message} (see {self.prog} --help)\n")


def up_parser() -> Parser:
    p = Parser(prog="tutti up", description="Runs the node daemon until Ctrl-C or SIGTERM: it owns the storage "
               "paths, hands each engine process its share of the file pool (engines attach over "
               "<data_dir>/tutti.sock), keeps the node-wide index and serves the node's admin API; with --etcd "
               "it registers this node's units in the cluster directory and serves them to other nodes. "
               "With --demo it pushes a synthetic prefix through one store instead, and exits. Every flag "
               "is also a TUTTI_<NAME> environment variable.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks on errors")
    d = p.add_argument_group("demo")
    d.add_argument("--demo", action="store_true", help="store a synthetic Llama-3-8B-shaped prefix, retrieve it "
                   "into other blocks, check every byte, print hit rate and bandwidth, and exit")
    d.add_argument("--tokens", type=int, metavar="N", help="demo prefix length in tokens "
                   "[default: 8192; the demo's pool holds max(1, N/4096) GiB unless --capacity-gb says]")
    d.add_argument("--keep", action="store_true", help="keep the demo's pool files afterwards (default: "
                   "removed when the demo ends)")
    add_config_arguments(p, default_notes={"instance": "default; the demo's: demo"})
    return p


def top_parser() -> Parser:
    p = Parser(prog="tutti", description="Tutti-cluster: an SSD-backed KV-cache store for long-context LLM "
               "serving. `tutti COMMAND --help` for a command's flags.",
               epilog="Start here: `tutti up --demo` (a single node on the embedded default, no services).")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks on errors")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", title="commands")
    for name, text in COMMANDS:
        sub.add_parser(name, help=text, add_help=False)
    return p


def config_from_args(a: argparse.Namespace, **extra: Any) -> TuttiConfig:
    """The config from the flags that were given (then environment, file, defaults) and ``extra``."""
    args = config_arguments(a)
    args.update({k: v for k, v in extra.items() if v is not None})
    return load_config(**args)


def cmd_demo(a: argparse.Namespace) -> int:
    from tutti_cluster.demo import run_demo

    tokens = a.tokens or DEMO_TOKENS
    if tokens <= 0:
        raise _UsageError(f"--tokens must be positive, not {tokens}")
    cfg = config_from_args(a, instance=a.instance or "demo",
                           capacity_gb=None if a.capacity_gb else str(max(1.0, tokens / 4096)))
    check_paths(cfg)  # before the demo spends its time making KV
    r = run_demo(cfg, prefix_tokens=tokens, keep=a.keep)
    print(f"Tutti demo: Llama-3-8B shape, {r.prefix_tokens} tokens, store at {', '.join(map(str, cfg.storage_paths()))}"
          f" ({'O_DIRECT' if r.direct_io else 'buffered I/O'})")
    print(f"  hit rate      {r.hit_rate * 100:6.1f} %")
    print(f"  store         {r.store_gbps:6.2f} GB/s")
    print(f"  retrieve      {r.retrieve_gbps:6.2f} GB/s")
    print(f"  byte-exact    {'yes' if r.exact else 'NO'}")
    gib = r.pool_bytes / (1 << 30)
    files = ", ".join(map(str, r.pool_files))
    if a.keep:
        print(f"  pool kept     {gib:.2f} GiB in {files} (remove it with: rm {' '.join(map(str, r.pool_files))})")
    else:
        print(f"  pool removed  {gib:.2f} GiB ({files}); --keep keeps it")
    return 0 if r.exact and r.hit_rate == 1.0 else 1


def check_paths(cfg: TuttiConfig) -> None:
    """StorageError unless every configured storage path is a writable directory (the embedded
    default, ``<data_dir>/store``, is made when missing)."""
    import os

    from tutti_cluster.errors import StorageError

    for p in cfg.paths:
        if not p.exists():
            raise StorageError(f"storage path {p} does not exist: create it (a directory on the SSD to use), or leave "
                               "--paths out for the embedded default <data_dir>/store")
        if not p.is_dir():
            raise StorageError(f"storage path {p} is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise StorageError(f"storage path {p} is not writable by this user")


def running_daemon(cfg: TuttiConfig) -> int | None:
    """The process id of a node daemon serving ``cfg.data_dir`` (one answers on its socket), else None."""
    import socket
    import struct

    from tutti_cluster.node.protocol import socket_path

    path = socket_path(cfg)
    if not path.exists():
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return None  # a stale socket of a daemon that died: the new one replaces it
        cred = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", cred)[0])


def cmd_up(a: argparse.Namespace) -> int:
    if a.demo:
        return cmd_demo(a)
    if a.keep or a.tokens is not None:
        raise _UsageError("--keep and --tokens belong to --demo")
    from tutti_cluster.node.daemon import run_daemon

    cfg = config_from_args(a)
    pid = running_daemon(cfg)  # before the admin API takes its port, which that daemon holds
    if pid is not None:
        from tutti_cluster.errors import ConfigError

        raise ConfigError(f"a node daemon already serves {cfg.data_dir} (pid {pid}): stop it first (kill {pid}), "
                          "or give this one another --data-dir")
    if cfg.etcd:
        from tutti_cluster.cluster.auth import cluster_secret

        cluster_secret(cfg)  # no credential: a ConfigError saying how to make one, before anything listens
    admin = _admin_plane(cfg)

    def ready(_: Any) -> None:
        mode = f"cluster (etcd {','.join(cfg.etcd)})" if cfg.cluster_mode else "single node (embedded default)"
        caps = ", ".join(f"{p} ({c / (1 << 30):g} GiB)" for p, c in zip(cfg.storage_paths(), cfg.capacity_bytes()))
        if cfg.memory_paths:
            caps += "; memory tier " + ", ".join(f"{p} ({c / (1 << 30):g} GiB)"
                                                 for p, c in zip(cfg.memory_paths, cfg.memory_capacity_bytes()))
        print(f"tutti node daemon serving: {mode}; data {cfg.data_dir}; paths {caps}. Engines attach through "
              f"{cfg.data_dir / 'tutti.sock'} (TUTTI_DATA_DIR={cfg.data_dir}). Ctrl-C stops it.", flush=True)
        if not cfg.cluster_mode and cfg.cluster_secret_file is None:
            _single_node_key(cfg)
        if admin is not None:
            admin.start()
            print(f"tutti admin API on http://{admin.address} (health: http://{admin.health_address}/livez, "
                  f"/readyz); token: {admin.token_note}", flush=True)

    try:
        stopped = run_daemon(cfg, ready=ready, advertise={"admin": admin.advertised} if admin is not None else None)
    finally:
        if admin is not None:
            admin.stop()
    if not stopped:  # a stop that hangs (logged): end the process now, whatever threads are left
        import os

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


def _single_node_key(cfg: TuttiConfig) -> None:
    """A single node's cluster credential, <data_dir>/cluster.key, made on first start (mode 0600,
    never over anything there): the file to give other nodes when this one joins a cluster."""
    from tutti_cluster.cluster.auth import KEY_FILE_NAME, ensure_secret_file

    path = cfg.data_dir / KEY_FILE_NAME
    try:
        _, made = ensure_secret_file(path)
    except TuttiError as e:
        log.warning("no cluster credential in the data directory: %s", e)
        return
    if made:
        log.info("cluster credential made: %s (mode 0600); a cluster's nodes and engines all take the same file "
                 "(--cluster-secret-file)", path)


def cmd_cluster_key(argv: list[str]) -> int:
    p = Parser(prog="tutti cluster-key", description="Writes a new cluster credential to PATH: 64 random hex "
               "digits, mode 0600, never over an existing file. Give every node daemon and engine of the cluster "
               "the same file (--cluster-secret-file, TUTTI_CLUSTER_SECRET_FILE; in Kubernetes a Secret).")
    p.add_argument("path", metavar="PATH", help="the file to create")
    a = p.parse_args(argv)
    from tutti_cluster.cluster.auth import write_secret_file

    write_secret_file(a.path)
    print(f"cluster credential written to {a.path} (mode 0600)")
    return 0


def _admin_plane(cfg: TuttiConfig) -> Any:
    """The node's admin API (tutti_control, imported only here), bound but not started; None, with
    a warning, where the admin extra is not installed."""
    try:
        from tutti_control.serve import NodeAdmin

        return NodeAdmin(cfg)
    except ImportError as e:
        log.warning("admin API not served (%s): %s", e, install_hint("admin"))
        return None


class _UsageError(Exception):
    pass


def _missing_module(e: ImportError) -> str | None:
    """The install hint for an optional module that failed to import, else None."""
    name = (e.name or "").split(".")[0]
    extra = _EXTRAS.get(name)
    return install_hint(extra) if extra is not None else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tutti`` console script (see the module docstring for errors and status)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = False
    while argv and argv[0] in ("-v", "--verbose"):
        verbose = True
        argv = argv[1:]
    verbose = verbose or any(x in ("-v", "--verbose") for x in argv[: argv.index("--") if "--" in argv else None])
    try:
        return _dispatch(argv, verbose)
    except KeyboardInterrupt:
        return 130
    except _UsageError as e:
        print(f"tutti: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001: every failure is one line; -v shows where it came from
        if verbose:
            traceback.print_exc()
        if isinstance(e, TuttiError):
            print(f"tutti: error: {e}", file=sys.stderr)
        elif isinstance(e, ImportError) and _missing_module(e):
            print(f"tutti: error: {argv[0] if argv else 'tutti'} needs {e.name} ({e}): {_missing_module(e)}",
                  file=sys.stderr)
        else:
            hint = "" if verbose else " (run with -v for the traceback)"
            print(f"tutti: error: {type(e).__name__}: {e}{hint}", file=sys.stderr)
        return 2


class _Plain(logging.Formatter):
    """``tutti: message`` for information, ``tutti: warning: message`` above it; -v names the logger."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"tutti: {level}{record.getMessage()}"


def _logging(verbose: bool, quiet: tuple[str, ...] = ()) -> None:
    """Logging to stderr; ``quiet`` loggers show only warnings unless ``verbose``."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s") if verbose else _Plain())
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    for name in quiet if not verbose else ():
        logging.getLogger(name).setLevel(logging.WARNING)


def _dispatch(argv: list[str], verbose: bool) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        top_parser().print_help()
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "up":
        a = up_parser().parse_args(rest)
        # The demo says in its own lines what the store does; the store's own lines are for -v.
        _logging(verbose, quiet=("tutti_cluster.store",) if a.demo else ())
        return cmd_up(a)
    if cmd == "bench" and rest[:1] == ["cluster"]:
        from tutti_cluster.bench import cluster as cluster_bench

        a = cluster_bench.build_parser(Parser, prog="tutti bench cluster").parse_args(rest[1:])
        _logging(verbose)
        return int(cluster_bench.run_args(a, rest[1:]) or 0)
    if cmd == "bench" and rest[:1] == ["tiers"]:
        from tutti_cluster.bench import tiers

        a = tiers.build_parser(Parser, prog="tutti bench tiers").parse_args(rest[1:])
        _logging(verbose or a.verbose)
        return int(tiers.run_args(a) or 0)
    if cmd == "bench" and rest[:1] == ["vllm"]:
        from tutti_cluster.bench import vllm_restore  # vLLM and PyTorch only in the engine processes

        a = vllm_restore.build_parser(Parser, prog="tutti bench vllm").parse_args(rest[1:])
        _logging(verbose or a.verbose)
        return int(vllm_restore.run_args(a) or 0)
    if cmd == "bench":
        from tutti_cluster.bench.args import build_parser

        a = build_parser(Parser).parse_args(rest)
        _logging(verbose)
        from tutti_cluster.bench.runner import run_args  # PyTorch: the benchmark's KV tensors are torch tensors

        return int(run_args(a) or 0)
    if cmd == "profile":
        from tutti_cluster.bench.prefill.profile import build_parser as profile_parser, run_args as profile_run

        a = profile_parser(Parser).parse_args(rest)
        _logging(verbose)
        return int(profile_run(a) or 0)
    if cmd == "cluster-key":
        return cmd_cluster_key(rest)
    if cmd == "admin":
        try:
            from tutti_control.cli import parser as admin_parser, run_args as admin_run
        except ImportError as e:
            raise _UsageError(f"tutti admin needs the tutti_control package ({e}): {install_hint('admin')}") from None
        a = admin_parser(Parser).parse_args(rest)
        # httpx logs every request at INFO: -v shows them.
        _logging(verbose, quiet=("httpx", "httpcore"))
        return int(admin_run(a) or 0)
    top_parser().error(f"unknown command {cmd!r}; the commands are {', '.join(n for n, _ in COMMANDS)}")


if __name__ == "__main__":
    sys.exit(main())

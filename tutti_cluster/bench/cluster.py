"""Cluster benchmark: remote fetch against the raw Transfer Engine, and directory lookup latency.

Run ``python -m tutti_cluster.bench.cluster [--quick] [--json out.json]``. It starts (unless
``--etcd`` names one) a private etcd on free ports, then:

1. An owner node in a separate process: the node daemon in cluster mode plus one engine store
   attached to it, holding N cache units of the Llama-3-8B shape (32 layers, 8 KV heads, head size
   128, bf16, 16-token blocks, 256-token units: 32 MiB per unit) written through the store.
2. In this process, a requester engine store with a :class:`ClusterClient`. Alternating, in the same
   run: (a) raw Transfer Engine: N pulls of one unit's size from the owner's registered arena,
   cycling through the slots of both arenas (as the fetch does; one buffer pulled into one buffer
   would stay in the CPU caches), one at a time, with as many in flight as the fetch has, and
   through Mooncake's ``transfer_sync_read``; (b) the owner's SSD read alone:
   ``store.read_unit_into`` of the N units into page-aligned buffers, with as many threads as the
   stage endpoint reads with (and with one); (c) remote fetch:
   ``ClusterClient.retrieve_remote`` of the N units, which is the whole path (the owner daemon reads
   each unit from its SSD straight into a registered slot, the requester pulls it with the Transfer
   Engine into its own registered slot and scatters it into its KV blocks, checksums verified at
   the requester). Medians are reported with the ratios remote / fastest raw and remote / owner
   read, and each repetition's fetch against the fastest raw figure of the same repetition.
3. Directory lookups (``EtcdDirectory.lookup``, prefix mode, all hits: the most work) for batches
   of 1 to 4096 keys, and etcd's database bytes per registered replica, measured by registering
   synthetic replicas under a separate lease.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GiB = float(1 << 30)
# Llama-3-8B: 32 layers, 8 KV heads x 128 x bf16 = 2 KiB per token per K (and per V).
LAYERS = 32
BLOCK_TOKENS = 16
BLOCK_BYTES = BLOCK_TOKENS * 8 * 128 * 2
UNIT_TOKENS = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Etcd:
    """A private single-member etcd (Debian etcd-server) for the benchmark."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            from tutti_cluster.errors import ConfigError

            raise ConfigError("the cluster benchmark starts its own etcd, and there is none on the PATH: "
                              "install Debian's etcd-server, or pass --etcd host:port")
        self.port, peer = _free_port(), _free_port()
        c, p = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        self.log = open(workdir / "etcd.log", "ab")
        self.proc = subprocess.Popen(
            [binary, "--name", "bench", "--data-dir", str(workdir / "etcd"), "--listen-client-urls", c,
             "--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
             "--initial-cluster", f"bench={p}", "--max-txn-ops", "4096", "--log-level", "warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if _gateway(self.endpoint, "/health", None).get("health") == "true":
                    return
            except (OSError, ValueError):
                time.sleep(0.1)
        raise SystemExit("private etcd did not become healthy")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def rss_bytes(self) -> int:
        """Resident memory of the etcd process (its in-memory key index grows with the directory)."""
        try:
            with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def _gateway(endpoint: str, path: str, body: dict | None) -> dict:
    """etcd's JSON gateway (used only for the status/health figures of the benchmark)."""
    host, _, port = endpoint.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        return dict(json.loads(conn.getresponse().read()))
    finally:
        conn.close()


def _kv(n_blocks: int, layers: int) -> list[Any]:
    import numpy as np

    return [np.zeros((2, n_blocks, BLOCK_BYTES), dtype=np.uint8) for _ in range(layers)]


# -- owner process ------------------------------------------------------------------------------------
def _owner_main(opts: dict[str, Any]) -> None:
    import numpy as np

    from tutti_cluster.config import TuttiConfig
    from tutti_cluster.node.daemon import NodeDaemon
    from tutti_cluster.node.link import DaemonLink
    from tutti_cluster.store import TuttiStore

    logging.basicConfig(level=logging.WARNING)
    cfg = TuttiConfig(**opts["config"])
    daemon = NodeDaemon(cfg, arena_bytes=opts["arena_bytes"]).start()
    n, layers = opts["units"], opts["layers"]
    ub = UNIT_TOKENS // BLOCK_TOKENS
    kv = _kv(n * ub, layers)
    rng = np.random.default_rng(1)
    for t in kv:
        t[:] = rng.integers(0, 256, size=t.shape, dtype=np.uint8)
    store = TuttiStore(cfg)
    store.register_kv_caches(kv, block_tokens=BLOCK_TOKENS, layout="kv_first")
    link = DaemonLink(cfg)
    link.attach(store)
    res = store.store(opts["keys"], list(range(n * ub)))
    link.flush()
    # The owner's own limit: its SSD read path, the store's read into a page-aligned buffer
    # (read_unit_into, O_DIRECT in place), which the stage endpoint runs for every unit of a remote
    # fetch into its registered slots. Measured on request, between the fetches, with as many
    # threads as the stage endpoint reads with.
    import mmap
    import threading
    from concurrent.futures import ThreadPoolExecutor

    assert daemon.transfer is not None and daemon.stage is not None
    unit = int(store.geometry()["slot_bytes"])
    local = threading.local()

    def read(key: int) -> int:
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, unit)  # page-aligned, one per thread
        return int(store.read_unit_into(key, local.buf, verify=False))

    def read_rate(threads: int) -> float:
        with ThreadPoolExecutor(threads) as ex:
            t0 = time.perf_counter()
            nbytes = sum(ex.map(read, opts["keys"]))
            return nbytes / (time.perf_counter() - t0) / GiB

    print(json.dumps({"ready": True, "stored": res.units, "config": opts["config"], "segment": daemon.transfer.segment,
                      "arena_slots": daemon.transfer.slot_addresses(), "stage": daemon.stage.address,
                      "readers": daemon.stage.readers,
                      "unit_bytes": unit, "direct_io": bool(store.stats().get("direct_io"))}), flush=True)
    for line in sys.stdin:  # the benchmark asks for read rates, then closes our stdin
        cmd = json.loads(line)
        print(json.dumps({"read_gibps": read_rate(int(cmd["threads"]))}), flush=True)
    link.close()
    store.close()
    daemon.stop()


# -- requester side -----------------------------------------------------------------------------------
def _measure_fetch(args: argparse.Namespace, etcd: str, work: Path) -> dict[str, Any]:
    from tutti_cluster.cluster.client import ClusterClient
    from tutti_cluster.cluster.stage_stream import default_depth
    from tutti_cluster.config import TuttiConfig
    from tutti_cluster.store import TuttiStore

    n, layers = args.units, args.layers
    ub = UNIT_TOKENS // BLOCK_TOKENS
    keys = [0xBE00_0000 + i for i in range(n)]
    owner_dir = Path(args.owner_path) if args.owner_path else work / "owner-ssd"
    owner_dir.mkdir(parents=True, exist_ok=True)
    from tutti_cluster.cluster.auth import write_secret_file

    secret_file = str(write_secret_file(work / "cluster.key"))  # the credential both nodes hold
    unit_guess = layers * 2 * ub * BLOCK_BYTES + (1 << 20)
    cap_gb = (n + 2) * unit_guess / GiB
    owner_cfg = {"paths": [str(owner_dir)], "capacity_gb": cap_gb, "unit_tokens": UNIT_TOKENS,
                 "data_dir": str(work / "owner"), "etcd": etcd, "node_id": "bench-owner", "instance": "engine0",
                 "lease_ttl_s": 10, "protocol": args.protocol, "cluster_secret_file": secret_file}
    opts = {"config": owner_cfg, "units": n, "layers": layers, "keys": keys, "arena_bytes": 4 * unit_guess}
    owner = subprocess.Popen([sys.executable, "-m", "tutti_cluster.bench.cluster", "--owner", json.dumps(opts)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(work / "owner.log", "ab"))
    try:
        assert owner.stdout is not None
        ready = json.loads(owner.stdout.readline() or b"{}")
        if not ready.get("ready") or ready["stored"] != n:
            raise SystemExit(f"owner failed to start or store (see {work / 'owner.log'}): {ready}")
        req_dir = work / "req-ssd"
        req_dir.mkdir(exist_ok=True)
        req_cfg: dict[str, Any] = {"paths": [str(req_dir)], "capacity_gb": max(0.1, 2 * unit_guess / GiB),
                                   "unit_tokens": UNIT_TOKENS, "data_dir": str(work / "req"), "etcd": [etcd],
                                   "node_id": "bench-requester", "instance": "engine0", "protocol": args.protocol,
                                   "cluster_secret_file": secret_file}
        kv: list[Any]  # torch tensors on the GPU, numpy arrays on the host
        if args.device == "cuda":
            import torch

            req_cfg["backend"] = "cuda"
            kv = [torch.ones((2, n * ub, BLOCK_BYTES), dtype=torch.uint8, device="cuda") for _ in range(layers)]
        else:
            kv = _kv(n * ub, layers)
            for t in kv:
                t.fill(1)  # an engine's KV memory is in use: no first-touch page faults in the figures
        cfg = TuttiConfig(**req_cfg)
        store = TuttiStore(cfg)
        store.register_kv_caches(kv, block_tokens=BLOCK_TOKENS, layout="kv_first")
        extra = {"window": args.window} if args.window else {}
        client = ClusterClient(store, cfg, arena_bytes=4 * unit_guess, timeout_s=30, **extra)
        unit_bytes = int(ready["unit_bytes"])
        total = n * unit_bytes
        assert client.lookup(keys) == n, "requester does not see the owner's units"
        te = client.transfer
        # The raw pulls cycle through every slot of both arenas, as the fetch does (pulling one
        # buffer into one buffer over and over would be served partly from the CPU caches), with
        # as many local slots as the fetch's stream uses: taken for the raw pulls, given back
        # before each fetch.
        depth = min(te.num_slots, default_depth())
        inflight = max(1, depth - 1)  # as StageStream: one slot is being scattered
        remotes = [int(a) for a in ready["arena_slots"]]
        raw, raw_par, remote, disk, disk1 = [], [], [], [], []
        locals_: list[int] = []

        def raw_pulls(concurrent: int) -> float:
            pending: deque[Any] = deque()
            t0 = time.perf_counter()
            for i in range(n):
                if len(pending) == concurrent:
                    te.wait(pending.popleft())
                pending.append(te.start_read(ready["segment"], locals_[i % len(locals_)], remotes[i % len(remotes)],
                                             unit_bytes))
            while pending:
                te.wait(pending.popleft())
            return total / (time.perf_counter() - t0) / GiB

        def owner_read(threads: int) -> float:
            assert owner.stdin is not None and owner.stdout is not None
            owner.stdin.write(json.dumps({"threads": threads}).encode() + b"\n")
            owner.stdin.flush()
            return float(json.loads(owner.stdout.readline())["read_gibps"])

        # CPU seconds of both processes (owner and requester) per GiB moved, in each phase: on a
        # host whose cores are all busy, the fetch's extra CPU work (the checksums, the
        # scatter) comes out of the transfer's share.
        cpu_raw = cpu_remote = 0.0

        def cpu_s() -> float:
            return _cpu_seconds(os.getpid()) + _cpu_seconds(owner.pid)

        raw_sync: list[float] = []
        for _ in range(args.reps):
            # Raw Transfer Engine, three ways: TransferNode pulls one at a time and with as many in
            # flight as the fetch has (submit, then wait with sleeps: what the fetch uses), and
            # Mooncake's transfer_sync_read (one at a time, waits spinning on one core).
            locals_[:] = [a for a in (te.acquire(5) for _ in range(depth)) if a is not None]
            assert len(locals_) == depth, "the fetch did not give its slots back"
            c0 = cpu_s()
            raw.append(raw_pulls(1))
            cpu_raw += cpu_s() - c0
            raw_par.append(raw_pulls(inflight))
            t0 = time.perf_counter()
            for i in range(n):
                te.read_sync(ready["segment"], locals_[i % len(locals_)], remotes[i % len(remotes)], unit_bytes)
            raw_sync.append(total / (time.perf_counter() - t0) / GiB)
            for a in locals_:
                te.release(a)
            disk.append(owner_read(int(ready["readers"])))
            disk1.append(owner_read(1))
            client.lookup(keys)
            c0, t0 = cpu_s(), time.perf_counter()
            placed = client.retrieve_remote(keys, list(range(n * ub)))
            dt = time.perf_counter() - t0
            cpu_remote += cpu_s() - c0
            if placed != n:
                raise SystemExit(f"remote fetch placed {placed} of {n} units: {client.stats}")
            remote.append(total / dt / GiB)
        exact = _same_as_owner(kv, n * ub)
        if not exact:
            raise SystemExit("remote fetch placed units whose bytes differ from the owner's")
        owner_stats = _owner_stage_stats(ready)
        reps_n = args.reps * n
        split = {"owner_read_ms_per_unit": 1e3 * owner_stats.get("read_s", 0.0) / max(1, owner_stats.get("units_staged", 1)),
                 "pull_ms_per_unit": 1e3 * client.stats["pull_s"] / reps_n,
                 "scatter_ms_per_unit": 1e3 * client.stats["scatter_s"] / reps_n}
        client.close()
        store.close()
        raw_med, rem_med, disk_med = statistics.median(raw), statistics.median(remote), statistics.median(disk)
        sync_med, par_med = statistics.median(raw_sync), statistics.median(raw_par)
        best_raw = max(raw_med, sync_med, par_med)
        return {"units": n, "unit_bytes": unit_bytes, "layers": layers, "window": client.window,
                "device": args.device, "byte_exact": exact,
                "owner_readers": ready["readers"], "owner_direct_io": ready["direct_io"],
                "raw_te_gibps": raw, "raw_te_sync_gibps": raw_sync, "raw_te_sync_gibps_median": sync_med,
                "pulls_in_flight": inflight, "raw_te_parallel_gibps": raw_par, "raw_te_parallel_gibps_median": par_med,
                # Each repetition's fetch against the fastest raw figure of the same repetition.
                "paired_ratios": [r / max(a, b, c) for r, a, b, c in zip(remote, raw, raw_sync, raw_par)],
                "remote_fetch_gibps": remote, "owner_read_gibps": disk,
                "owner_read_1thread_gibps": disk1,
                "raw_te_gibps_median": raw_med, "remote_fetch_gibps_median": rem_med,
                "owner_read_gibps_median": disk_med, "owner_read_1thread_gibps_median": statistics.median(disk1),
                # Against the fastest of the three raw figures of this run.
                "ratio": rem_med / best_raw if best_raw else 0.0,
                "ratio_to_owner_read": rem_med / disk_med if disk_med else 0.0, "time_split": split,
                "cpu_s_per_gib_raw": cpu_raw / (args.reps * total / GiB),
                "cpu_s_per_gib_remote": cpu_remote / (args.reps * total / GiB)}
    finally:
        if owner.stdin is not None:
            owner.stdin.close()
        try:
            owner.wait(20)
        except subprocess.TimeoutExpired:
            owner.kill()
            owner.wait()


def _same_as_owner(kv: list[Any], n_blocks: int) -> bool:
    """Whether the requester's KV (numpy or a GPU tensor per layer) holds the owner's bytes (its
    KV, as `_owner_main` fills it)."""
    import numpy as np

    rng = np.random.default_rng(1)
    for t in kv:
        want = rng.integers(0, 256, size=(2, n_blocks, BLOCK_BYTES), dtype=np.uint8)
        got = t.cpu().numpy() if hasattr(t, "cpu") else t
        if not np.array_equal(got, want):
            return False
    return True


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, all its threads (from /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _owner_stage_stats(ready: dict[str, Any]) -> dict[str, float]:
    """The owner daemon's stage counters, asked through its socket."""
    from tutti_cluster.config import TuttiConfig
    from tutti_cluster.node.link import DaemonLink

    link = DaemonLink(TuttiConfig(**ready["config"]), timeout_s=5)
    try:
        return dict(link.request({"op": "stats"}).get("stage", {}))
    except (OSError, ValueError):
        return {}
    finally:
        link.close()


def _measure_lookup(args: argparse.Namespace, etcd: str, rss: Any = None) -> dict[str, Any]:
    from tutti_cluster.cluster.auth import ClusterSecret
    from tutti_cluster.cluster.directory import EtcdDirectory, NodeRecord

    secret = ClusterSecret.generate()  # signs the writer's entries; the reader verifies each one it reads
    writer = EtcdDirectory(etcd, "bench-dir", lease_ttl_s=30, timeout_s=30, max_txn_ops=args.txn_ops, secret=secret)
    reader = EtcdDirectory(etcd, "bench-reader", timeout_s=30, max_txn_ops=args.txn_ops, secret=secret)
    before = _gateway(etcd, "/v3/maintenance/status", {})
    rss_before = rss() if rss else 0
    n_keys = args.directory_keys
    keys = [0xD1_0000_0000 + i * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF for i in range(n_keys)]
    writer.register(keys)  # queued: start() writes them under the new lease
    t0 = time.perf_counter()
    writer.start(NodeRecord("bench-dir", "", ""))
    reg_s = time.perf_counter() - t0
    after = _gateway(etcd, "/v3/maintenance/status", {})
    rss_after = rss() if rss else 0
    in_use = "dbSizeInUse" if "dbSizeInUse" in after else "dbSize"
    per_key = (int(after[in_use]) - int(before.get(in_use, 0))) / n_keys
    rows = []
    for batch in (1, 4, 16, 64, 256, 1024, 4096):
        if batch > n_keys:
            break
        reps = max(5, min(args.lookup_reps, 40000 // batch))
        lat = []
        for r in range(reps):
            start = (r * batch) % (n_keys - batch + 1)
            t0 = time.perf_counter()
            owners = reader.lookup(keys[start:start + batch], prefix=True)
            lat.append((time.perf_counter() - t0) * 1e3)
            if len(owners) != batch:
                raise SystemExit(f"lookup of {batch} keys found {len(owners)}")
        lat.sort()
        rows.append({"batch": batch, "reps": reps, "p50_ms": statistics.median(lat),
                     "p90_ms": lat[min(len(lat) - 1, int(0.9 * len(lat)))], "us_per_key": statistics.median(lat) * 1e3 / batch})
    writer.stop(revoke=True)
    reader.stop(revoke=False)
    return {"registered_keys": n_keys, "txn_ops": reader.max_txn_ops,
            "etcd_rss_bytes_per_replica": (rss_after - rss_before) / n_keys if rss else None, "register_seconds": reg_s, "db_bytes_per_replica": per_key,
            "db_size_field": in_use, "lookup": rows}


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
                 prog: str = "python -m tutti_cluster.bench.cluster") -> argparse.ArgumentParser:
    p = parser_class(prog=prog, description=(__doc__ or "").split("\n")[0] + " Needs the cluster extra "
                     "(pip install 'tutti-cluster[cluster]') and etcd on the PATH unless --etcd names one.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks on errors")
    p.add_argument("--quick", action="store_true", help="small sizes, finishes in about a minute on 2 cores")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--etcd", help="use this etcd (host:port) instead of a private one")
    p.add_argument("--owner-path", help="storage directory of the owner node (default: a temporary directory)")
    p.add_argument("--units", type=int, help="cache units fetched per repetition (default 16, quick 6)")
    p.add_argument("--layers", type=int, default=LAYERS, help="model layers (default 32: Llama-3-8B)")
    p.add_argument("--reps", type=int, help="alternating raw/remote repetitions (default 5, quick 3)")
    p.add_argument("--window", type=int, help="units the owner stages ahead (default: ClusterClient's)")
    p.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="the requesting engine's KV cache: host memory (CPU backend) or GPU memory (CUDA backend)")
    p.add_argument("--directory-keys", type=int, help="synthetic replicas registered (default 65536, quick 8192)")
    p.add_argument("--lookup-reps", type=int, default=50)
    p.add_argument("--txn-ops", type=int, default=1024, help="directory operations per etcd transaction")
    p.add_argument("--only", choices=["fetch", "lookup"], help="run one part only")
    p.add_argument("--owner", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_args(build_parser().parse_args(argv), argv)


def run_args(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """The benchmark with its flags parsed (``argv`` only goes into the report)."""
    if args.owner:
        _owner_main(json.loads(args.owner))
        return 0
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    args.units = args.units or (6 if args.quick else 16)
    args.reps = args.reps or (3 if args.quick else 5)
    args.directory_keys = args.directory_keys or (8192 if args.quick else 65536)
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="tutti-cluster-bench-"))
    etcd = None
    try:
        if args.etcd:
            endpoint = args.etcd
        else:
            etcd = _Etcd(work)
            endpoint = etcd.endpoint
        fetch = _measure_fetch(args, endpoint, work) if args.only != "lookup" else None
        lookup = _measure_lookup(args, endpoint, etcd.rss_bytes if etcd else None) if args.only != "fetch" else None
    finally:
        if etcd is not None:
            etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "machine": {"hostname": socket.gethostname(), "cores": os.cpu_count(), "kernel": platform.release(),
                    "python": platform.python_version(),
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "mc_tcp_slice_size": os.environ.get("MC_TCP_SLICE_SIZE"),
                    # Other jobs on the host lower every figure; the load says how busy it was.
                    "loadavg_1m_before": load_before[0], "loadavg_1m_after": os.getloadavg()[0]},
        "command": "python -m tutti_cluster.bench.cluster " + " ".join(argv if argv is not None else sys.argv[1:]),
        "fetch": fetch, "directory": lookup,
    }
    f = fetch
    if f is not None:
        print(f"remote fetch  {f['remote_fetch_gibps_median']:.3f} GiB/s   raw Transfer Engine "
              f"{f['raw_te_gibps_median']:.3f} GiB/s ({f['pulls_in_flight']} in flight "
              f"{f['raw_te_parallel_gibps_median']:.3f}, transfer_sync_read {f['raw_te_sync_gibps_median']:.3f})   "
              f"ratio {f['ratio']:.2f} (to the fastest raw; per repetition, median "
              f"{statistics.median(f['paired_ratios']):.2f})   "
              f"({f['units']} units x {f['unit_bytes'] / (1 << 20):.1f} MiB, {args.protocol}, into {args.device} "
              f"memory, byte-exact {f['byte_exact']})")
        print(f"owner SSD read (store.read_unit_into, {f['owner_readers']} threads as the stage endpoint) "
              f"{f['owner_read_gibps_median']:.3f} GiB/s (1 thread {f['owner_read_1thread_gibps_median']:.3f}), "
              f"O_DIRECT {f['owner_direct_io']}; remote fetch / owner read {f['ratio_to_owner_read']:.2f}")
        print("  per repetition: raw " + " ".join(f"{x:.3f}" for x in f["raw_te_gibps"]) + " | in flight "
              + " ".join(f"{x:.3f}" for x in f["raw_te_parallel_gibps"]) + " | sync "
              + " ".join(f"{x:.3f}" for x in f["raw_te_sync_gibps"]) + " | remote "
              + " ".join(f"{x:.3f}" for x in f["remote_fetch_gibps"]) + " | owner read "
              + " ".join(f"{x:.3f}" for x in f["owner_read_gibps"]))
        print(f"CPU seconds per GiB moved (owner + requester): raw {f['cpu_s_per_gib_raw']:.2f}, "
              f"remote fetch {f['cpu_s_per_gib_remote']:.2f}")
        ts = f["time_split"]
        print(f"per unit: owner read {ts['owner_read_ms_per_unit']:.1f} ms, pull {ts['pull_ms_per_unit']:.1f} ms, "
              f"scatter {ts['scatter_ms_per_unit']:.1f} ms")
    d = lookup
    if d is not None:
        print(f"directory: {d['db_bytes_per_replica']:.0f} etcd bytes per replica "
              f"({d['db_size_field']}, {d['registered_keys']} replicas, {d['txn_ops']} ops per transaction)")
        if d["registered_keys"] < 65536:
            # bbolt grows in pages and etcd's heap in chunks: small samples give noise, not sizes.
            print("  (size figures need --directory-keys 65536 or more)")
        if d["etcd_rss_bytes_per_replica"] is not None:
            print(f"etcd resident memory: {d['etcd_rss_bytes_per_replica']:.0f} bytes per replica")
        for r in d["lookup"]:
            print(f"  lookup {r['batch']:5d} keys: p50 {r['p50_ms']:8.2f} ms  p90 {r['p90_ms']:8.2f} ms  "
                  f"{r['us_per_key']:7.1f} us/key")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Real etcd and mooncake_master processes on 127.0.0.1 free ports, for cluster tests.

Nothing here is a fake: `EtcdServer` runs Debian's `etcd` binary and `MooncakeMaster` runs the
`mooncake_master` console script from PyPI `mooncake-transfer-engine-non-cuda`. Each test module
imports the fixtures it needs (``from cluster_fixtures import etcd_server, ...``); a module whose
components are missing is skipped with the reason.

Every node, engine and stage endpoint of the tests runs with the cluster credential on: one secret
file per test process (:func:`cluster_secret_file`, mode 0600), as every node of a cluster shares it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import atexit
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ETCD_BIN = shutil.which("etcd") or "/usr/bin/etcd"

_SECRET_FILE: Path | None = None


def cluster_secret_file() -> Path:
    """The test process's cluster credential file (made once, mode 0600, removed at exit): every
    node and engine of a test cluster is given it."""
    global _SECRET_FILE
    if _SECRET_FILE is None:
        from tutti_cluster.cluster.auth import write_secret_file

        d = Path(tempfile.mkdtemp(prefix="tutti-credential-"))
        atexit.register(shutil.rmtree, d, True)
        _SECRET_FILE = write_secret_file(d / "cluster.key")
    return _SECRET_FILE


def cluster_secret() -> Any:
    """The test process's cluster credential (a ClusterSecret read from :func:`cluster_secret_file`)."""
    from tutti_cluster.cluster.auth import ClusterSecret

    return ClusterSecret.from_file(cluster_secret_file())


def owner_handshake(conn: socket.socket, secret: Any = None) -> bool:
    """The owner's side of the stage handshake on an accepted connection, for the tests' fake
    owners (which then answer whatever they script); reads byte by byte, so that nothing past the
    requester's auth line is consumed. False when the requester does not prove the credential."""
    from tutti_cluster.cluster.auth import OWNER, REQUESTER, new_nonce
    from tutti_cluster.cluster.stage_wire import AuthOp, Hello, Welcome

    secret = secret or cluster_secret()
    nonce = new_nonce()
    conn.sendall(Hello(nonce=nonce.hex()).line())
    line = b""
    while not line.endswith(b"\n"):
        c = conn.recv(1)
        if not c:
            return False
        line += c
    msg = AuthOp.model_validate_json(line)
    theirs = bytes.fromhex(msg.nonce)
    index = secret.verify_proof(bytes.fromhex(msg.proof), REQUESTER, nonce, theirs)
    if index is None:
        return False
    conn.sendall(Welcome(proof=secret.prove(OWNER, nonce, theirs, index).hex()).line())
    return True


_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free now on every address, outside the kernel's ephemeral range.

    Ports the OS hands to ``bind(("", 0))`` come from the ephemeral range, which every outgoing
    connection (etcd clients, Transfer Engines, gRPC) also draws its source port from, so one of
    them can take the port between this call and the server's own bind (seen in CI: etcd exited
    with "address already in use"). Ports below that range are only ever taken by a bind, and
    none is handed out twice in one test process.
    """
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(20000, 32000)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free TCP port in 20000-32000")


def wait_port(port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None,
              host: str = "127.0.0.1") -> None:
    """Block until host:port accepts connections; raise if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


def mooncake_master_bin() -> str | None:
    """Path of the mooncake_master console script next to this interpreter, or on PATH."""
    cand = Path(sys.executable).with_name("mooncake_master")
    if cand.exists():
        return str(cand)
    return shutil.which("mooncake_master")


def stop_process(proc: subprocess.Popen, sig: int, grace_s: float) -> None:
    """Sends ``sig`` to a live process and waits; kills it if it outlives ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class EtcdServer:
    """One etcd member on 127.0.0.1 free ports; `stop()`/`start()` restart it on the same ports.

    `start(wipe=True)` starts from an empty data directory, as a replaced etcd pod would.
    """

    def __init__(self, workdir: Path, max_txn_ops: int = 4096, host: str = "127.0.0.1") -> None:
        self.workdir = workdir
        self.host = host
        self.client_port = free_port()
        self.peer_port = free_port()
        self.max_txn_ops = max_txn_ops
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "etcd.log"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self, wipe: bool = False) -> None:
        data = self.workdir / "etcd-data"
        if wipe and data.exists():
            shutil.rmtree(data)
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            ETCD_BIN, "--name", "tutti-test", "--data-dir", str(data),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"tutti-test={peer}",
            # One lookup batch of up to 4096 keys is one transaction.
            "--max-txn-ops", str(self.max_txn_ops),
            "--log-level", "warn",
        ]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_port(self.client_port, proc=self.proc, host=self.host)
        except RuntimeError as exc:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{exc}; etcd's log ends:\n{tail}") from None
        # The client port opens before the member has elected itself leader; wait for health.
        self._wait_ready()

    def _wait_ready(self, timeout: float = 20.0) -> None:
        import http.client

        wait_etcd_healthy(lambda: http.client.HTTPConnection(self.host, self.client_port, timeout=2), timeout)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            stop_process(self.proc, sig, 10)
        self.proc = None


class MooncakeMaster:
    """`mooncake_master` on a free RPC port (its metrics port is moved off the default too)."""

    def __init__(self, workdir: Path) -> None:
        binary = mooncake_master_bin()
        if binary is None:
            raise FileNotFoundError("mooncake_master not installed")
        self.binary = binary
        self.port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "mooncake_master.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            self.binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
            f"--metrics_port={self.metrics_port}", "--enable_metric_reporting=false",
        ]
        log = open(self.log_path, "ab")
        # The console script execs the binary, so this PID is the server's.
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_port(self.port, proc=self.proc)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            stop_process(self.proc, sig, 10)
        self.proc = None


def require_etcd() -> None:
    if not os.path.exists(ETCD_BIN):
        pytest.skip("Debian etcd-server is not installed (no etcd binary)")
    try:
        import grpc  # noqa: F401
    except ImportError:
        pytest.skip("grpcio is not installed (the directory's etcd client needs it)")


def require_mooncake() -> None:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:
        pytest.skip(f"mooncake-transfer-engine-non-cuda unusable (needs libibverbs1): {exc}")


def transfer_nodes(unit: int):  # type: ignore[no-untyped-def]
    """An owner's and a requester's Transfer Engine (TCP) with arenas of 4 and 3 slots of ``unit``
    bytes, as the stage-endpoint tests use them; the caller closes both."""
    require_mooncake()
    from tutti_cluster.cluster.transfer import TransferNode

    return TransferNode(arena_bytes=4 * unit, slot_bytes=unit), TransferNode(arena_bytes=3 * unit, slot_bytes=unit)


@pytest.fixture(scope="module")
def engines(request):  # type: ignore[no-untyped-def]
    """:func:`transfer_nodes` with the test module's ``UNIT``, shared by its tests, closed after them."""
    owner, requester = transfer_nodes(request.module.UNIT)
    yield owner, requester
    owner.close()
    requester.close()


def free_slots(node, n: int) -> int:  # type: ignore[no-untyped-def]
    """How many of a TransferNode's ``n`` arena slots can be taken now (all are given back); a slot
    that would come out twice (released twice) fails the test."""
    got = [a for a in (node.acquire(0) for _ in range(n + 1)) if a is not None]
    for a in got:
        node.release(a)
    assert len(got) == len(set(got)), "a slot was lent twice (released twice)"
    assert len(got) <= n, f"{len(got)} slots out of an arena of {n}"
    return len(got)


def wait_slots_free(node, n: int, within_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    """True once all ``n`` slots are free (an owner frees a slot when the requester's `done` reaches
    it, which may be after the stream ended on the requester's side)."""
    deadline = time.monotonic() + within_s
    while free_slots(node, n) != n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class StageConn:
    """A raw JSON-lines connection to a stage endpoint, as an attacker (or another version) talks:
    authenticated with ``secret`` (by default the tests' cluster credential), or, with
    ``secret=None``, left at the owner's hello (``self.hello``) for the caller to speak first."""

    _DEFAULT: Any = object()

    def __init__(self, address: str, timeout: float = 5.0, secret: Any = _DEFAULT) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.hello: dict | None = None
        if secret is not None:
            from tutti_cluster.cluster.stage_wire import _requester_handshake

            rest = _requester_handshake(self.sock, cluster_secret() if secret is StageConn._DEFAULT else secret,
                                        timeout)
            assert not rest, rest  # the owner says nothing before a request
        self.f = self.sock.makefile("rwb")
        if secret is None:
            self.hello = self.recv()

    def send(self, obj) -> None:  # type: ignore[no-untyped-def]
        """A line (bytes, sent as they are) or an object (sent as JSON)."""
        line = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.f.write(line if line.endswith(b"\n") else line + b"\n")
        self.f.flush()

    def recv(self) -> dict:
        line = self.f.readline()
        assert line, "the server closed the connection"
        return json.loads(line)

    def ask(self, obj) -> dict:  # type: ignore[no-untyped-def]
        self.send(obj)
        return self.recv()

    def ask_ping(self) -> bool:
        return self.ask({"op": "ping"}) == {"pong": True}

    def close(self) -> None:
        try:
            self.f.close()
        finally:
            self.sock.close()


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd for one test (tests restart and wipe it)."""
    require_etcd()
    srv = EtcdServer(tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    require_mooncake()
    master = MooncakeMaster(tmp_path)
    master.start()
    try:
        yield master
    finally:
        master.stop()


def scratch_dir(prefix: str = "tutti-cluster-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


# -- a cluster node as a separate process ------------------------------------------------------------
# `python cluster_fixtures.py node <config-json>` runs one node: the node daemon (NodeDaemon, cluster
# mode) and one engine store attached to it through the daemon socket, driven by JSON-lines commands
# on stdin. KV data is a pure function of the unit key, so any node can check any other node's bytes.

NODE_LAYERS = 4
NODE_BLOCKS = 64
NODE_BLOCK_BYTES = 16384
NODE_BLOCK_TOKENS = 16


def unit_payload(key: int, layer: int, unit_blocks: int):  # -> np.ndarray [2, unit_blocks, block_bytes]
    import numpy as np

    rng = np.random.default_rng([key & 0xFFFFFFFF, key >> 32, layer])
    return rng.integers(0, 256, size=(2, unit_blocks, NODE_BLOCK_BYTES), dtype=np.uint8)


def _node_main(cfg_json: str) -> None:
    import json as _json
    import logging

    import numpy as np

    from tutti_cluster import TuttiConfig, TuttiStore
    from tutti_cluster.cluster.client import ClusterClient
    from tutti_cluster.node.daemon import NodeDaemon
    from tutti_cluster.node.link import DaemonLink

    logging.basicConfig(level=logging.WARNING)
    opts = _json.loads(cfg_json)
    cfg = TuttiConfig(**opts["config"])
    # An engine-only process (with_daemon false) talks to a daemon that runs elsewhere, if any.
    daemon = NodeDaemon(cfg).start() if opts.get("with_daemon", True) else None
    if cfg.backend == "cuda":  # a GPU engine: its KV cache in GPU memory
        import torch

        kv = [torch.zeros((2, NODE_BLOCKS, NODE_BLOCK_BYTES), dtype=torch.uint8, device="cuda") for _ in range(NODE_LAYERS)]

        def put(layer: int, cols: slice, data: np.ndarray) -> None:
            kv[layer][:, cols] = torch.from_numpy(data).to("cuda")

        def get(layer: int, cols: slice) -> np.ndarray:
            torch.cuda.synchronize()
            return kv[layer][:, cols].cpu().numpy()
    else:
        kv = [np.zeros((2, NODE_BLOCKS, NODE_BLOCK_BYTES), dtype=np.uint8) for _ in range(NODE_LAYERS)]

        def put(layer: int, cols: slice, data: np.ndarray) -> None:
            kv[layer][:, cols] = data

        def get(layer: int, cols: slice) -> np.ndarray:
            return kv[layer][:, cols]
    store = TuttiStore(cfg)
    store.register_kv_caches(kv, block_tokens=NODE_BLOCK_TOKENS, layout="kv_first")
    link = DaemonLink(cfg)
    attached = link.attach(store)
    client = (ClusterClient(store, cfg, timeout_s=float(opts.get("timeout_s", 3.0)), link=link)
              if cfg.etcd else None)
    ub = store.unit_blocks

    def reply(obj: dict) -> None:
        sys.stdout.write(_json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": True, "stage": daemon.stage.address if daemon and daemon.stage else None, "pid": os.getpid(),
           "attached": attached is not None})
    for line in sys.stdin:
        msg = _json.loads(line)
        op = msg["op"]
        try:
            if op == "store":
                keys = [int(k) for k in msg["keys"]]
                for i, k in enumerate(keys):
                    for layer in range(NODE_LAYERS):
                        put(layer, slice(i * ub, (i + 1) * ub), unit_payload(k, layer, ub))
                res = store.store(keys, list(range(len(keys) * ub)))
                link.flush()
                reply({"ok": True, "units": res.units, "failed": list(res.failed_units)})
            elif op == "lookup":
                t0 = time.monotonic()
                keys = [int(k) for k in msg["keys"]]
                n = client.lookup(keys) if client else store.lookup(keys)
                reply({"ok": True, "hits": n, "local": store.lookup([int(k) for k in msg["keys"]]),
                       "seconds": time.monotonic() - t0})
            elif op == "fetch":
                keys = [int(k) for k in msg["keys"]]
                for layer in range(NODE_LAYERS):
                    put(layer, slice(None), np.zeros((2, NODE_BLOCKS, NODE_BLOCK_BYTES), dtype=np.uint8))
                t0 = time.monotonic()
                owners = None
                if msg.get("via_daemon"):
                    # As vLLM would split it: the scheduler asks the node daemon, the worker fetches
                    # with the owners it was handed (no lookup state of its own).
                    r = link.request({"op": "lookup", "keys": keys})
                    n, owners = r["local"] + len(r["remote"]), r["remote"]
                    if client:
                        client._owners.clear()
                else:
                    n = client.lookup(keys) if client else store.lookup(keys)
                local = store.lookup(keys)
                res = store.retrieve(keys[:local], list(range(local * ub))) if local else None
                placed = 0
                if client:
                    base = int(msg.get("block_base", local * ub))  # past the KV: a fault of our own
                    placed = client.retrieve_remote(keys[local:n], list(range(base, base + (n - local) * ub)),
                                                    keep_replica=bool(msg.get("keep", False)), owners=owners)
                secs = time.monotonic() - t0
                exact = []
                for i, k in enumerate(keys[:local + placed]):
                    exact.append(all(np.array_equal(get(layer, slice(i * ub, (i + 1) * ub)), unit_payload(k, layer, ub))
                                     for layer in range(NODE_LAYERS)))
                link.flush()
                reply({"ok": True, "lookup": n, "local": local, "placed": placed, "exact": exact,
                       "local_units": res.units if res else 0, "seconds": secs})
            elif op == "stats":
                reply({"ok": True, "daemon": daemon.stats() if daemon else None,
                       "client": client.stats if client else None, "store": store.stats(), "dropped": link.dropped})
            elif op == "tiers":
                reply({"ok": True, "tiers": store.unit_tiers([int(k) for k in msg["keys"]])})
            elif op == "evict":
                gone = [store.remove(int(k)) for k in msg["keys"]]
                link.flush()
                reply({"ok": True, "removed": gone})
            elif op == "exit":
                reply({"ok": True})
                break
            else:
                reply({"ok": False, "error": f"unknown op {op}"})
        except Exception as exc:  # reported to the test, which decides
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    link.close()
    store.close()
    if daemon is not None:
        daemon.stop()


class NodeProcess:
    """Test handle of one node process (daemon + engine store), see `_node_main`."""

    def __init__(self, name: str, etcd: str, workdir: Path, lease_ttl_s: int = 3, capacity_gb: float = 0.05,
                 paths: list[str] | None = None, timeout_s: float = 3.0, with_daemon: bool = True,
                 instance: str = "engine0", data_dir: Path | None = None, mooncake_master: str | None = None,
                 prefix: list[str] | None = None, backend: str = "auto", secret_file: Path | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        self.name = name
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        if paths is None:
            store_dir = self.workdir / "ssd"
            store_dir.mkdir(exist_ok=True)
            paths = [str(store_dir)]
        self.config = {"paths": paths, "capacity_gb": capacity_gb, "unit_tokens": 64,
                       "data_dir": str(data_dir or self.workdir), "etcd": etcd, "node_id": name,
                       "lease_ttl_s": lease_ttl_s, "instance": instance, "backend": backend,
                       "cluster_secret_file": str(secret_file or cluster_secret_file())}
        if mooncake_master:
            self.config["mooncake_master"] = mooncake_master
        self.config.update(extra or {})  # more TuttiConfig fields, for the daemon and the engine alike
        self.timeout_s = timeout_s
        self.log = open(self.workdir / "node.log", "ab")
        # `prefix` runs the node elsewhere, e.g. ["ip", "netns", "exec", ns] (which execs: same PID).
        self.proc = subprocess.Popen(
            list(prefix or []) + [sys.executable, __file__, "node",
             json.dumps({"config": self.config, "timeout_s": timeout_s, "with_daemon": with_daemon})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, cwd=str(self.workdir))
        first = self._read(60.0)
        if not first.get("ready"):
            raise RuntimeError(f"node {name} did not start: {first}")
        self.pid = int(first["pid"])
        self.attached = bool(first.get("attached"))

    def _read(self, timeout: float) -> dict:
        import select

        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            raise TimeoutError(f"node {self.name} did not answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait(timeout=5)
            raise RuntimeError(f"node {self.name} exited with status {rc} (see {self.workdir / 'node.log'})")
        return json.loads(line)

    def call(self, timeout: float = 60.0, **msg) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(timeout=10, op="exit")
                self.proc.wait(10)
            except Exception:
                self.kill()
        self.log.close()


def close_all(procs) -> None:  # type: ignore[no-untyped-def]
    """Closes node (or other) processes side by side: each one's exit takes about a second."""
    threads = [threading.Thread(target=p.close) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _daemon_main(cfg_json: str) -> None:
    import logging

    from tutti_cluster import TuttiConfig
    from tutti_cluster.node.daemon import run_daemon

    logging.basicConfig(level=logging.INFO)

    def ready(d) -> None:  # type: ignore[no-untyped-def]
        sys.stdout.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
        sys.stdout.flush()

    run_daemon(TuttiConfig(**json.loads(cfg_json)), ready=ready)


class DaemonProcess:
    """`run_daemon(config)` in its own process, as `tutti up` runs it."""

    def __init__(self, config: dict, log_path: Path) -> None:
        self.config = config
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, __file__, "daemon", json.dumps(config)],
                                     stdout=subprocess.PIPE, stderr=self.log)
        import select

        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if r else b""
        if not line or not json.loads(line).get("ready"):
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"daemon did not start (see {log_path})")

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        stop_process(self.proc, sig, 15)
        self.log.close()
        return self.proc.returncode


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "node":
        _node_main(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "daemon":
        _daemon_main(sys.argv[2])
    else:
        sys.exit("usage: cluster_fixtures.py node|daemon <json>")


def wait_for(pred, timeout: float = 10.0, step: float = 0.1):
    """Polls ``pred`` until it returns something true or ``timeout`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(step)


def wait_etcd_healthy(connect: Callable[[], Any], timeout: float = 20.0) -> None:
    """Wait until etcd's ``/health`` says true over the connection ``connect`` makes (plain HTTP or
    TLS): its client port opens before the member has elected itself leader."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            conn = connect()
            conn.request("GET", "/health")
            last = conn.getresponse().read().decode()
            conn.close()
            if json.loads(last).get("health") == "true":
                return
        except (OSError, ValueError) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise TimeoutError(f"etcd not healthy: {last}")

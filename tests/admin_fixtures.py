"""A node for the admin plane's tests: a real node daemon (`run_daemon`, its own process) and an
engine process with a real TuttiStore attached through the daemon socket (`cluster_fixtures`),
and the admin app over them, in process (ASGI) or served by uvicorn on loopback; or a whole
`tutti up` (daemon, admin API and health listener in one process)."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

from cluster_fixtures import DaemonProcess, NodeProcess, free_port, stop_process, wait_for
from tutti_cluster import TuttiConfig

TOKEN = "test-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class AdminNode:
    """One node: daemon process + engine process (instance ``engine0``) on ``workdir``."""

    def __init__(self, workdir: Path, node_id: str = "node-a", engine_capacity_gb: float = 0.02, **extra: Any) -> None:
        ssd = workdir / "ssd"
        ssd.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.cfg = {"paths": [str(ssd)], "capacity_gb": 0.05, "unit_tokens": 64, "data_dir": str(workdir / "node"),
                    "node_id": node_id, **extra}
        self.node_id = node_id
        self.engine_capacity_gb = engine_capacity_gb
        self.daemon = DaemonProcess(self.cfg, workdir / "daemon.log")
        self.engine: NodeProcess | None = None
        self.start_engine()

    @property
    def config(self) -> TuttiConfig:
        return TuttiConfig(**self.cfg)

    def start_engine(self, name: str = "engine0") -> NodeProcess:
        self.engine = NodeProcess(name, "", self.workdir, paths=self.cfg["paths"], capacity_gb=self.engine_capacity_gb,
                                  with_daemon=False, instance=name, data_dir=Path(self.cfg["data_dir"]))
        return self.engine

    def engine_stats(self) -> dict[str, Any]:
        assert self.engine is not None
        return dict(self.engine.call(op="stats")["store"])

    def store(self, keys: list[int]) -> None:
        """Store units of ``keys`` in the engine (16 per request: the engine's KV holds 16 units)."""
        assert self.engine is not None
        for i in range(0, len(keys), 16):
            r = self.engine.call(op="store", keys=keys[i:i + 16])
            assert r["ok"] and r["units"] == len(keys[i:i + 16]), r

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.daemon.stop()


class TuttiUp:
    """`tutti up` in its own process (node ``cli-node``); waits for the admin API's line. The health
    listener takes any free port unless ``extra`` names one."""

    def __init__(self, workdir: Path, port: int, env: dict[str, str] | None = None, *extra: str) -> None:
        self.data_dir = workdir / "node"
        ssd = workdir / "ssd"
        ssd.mkdir(parents=True, exist_ok=True)
        self.paths = [str(ssd)]
        self.log = open(workdir / "up.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tutti_cluster.cli", "up", "--data-dir", str(self.data_dir), "--paths", str(ssd),
             "--capacity-gb", "0.05", "--unit-tokens", "64", "--node-id", "cli-node", "--admin-host", "127.0.0.1",
             "--admin-port", str(port), "--health-port", "0", *extra],
            stdout=subprocess.PIPE, stderr=self.log, env={**os.environ, **(env or {})}, text=True)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        while not any(line.startswith("tutti admin API on") for line in self.lines):
            r, _, _ = select.select([self.proc.stdout], [], [], 60)
            line = self.proc.stdout.readline() if r else ""
            if not line:
                self.stop()
                raise RuntimeError(f"tutti up did not serve its admin API: {self.lines} (see {workdir / 'up.log'})")
            self.lines.append(line.strip())
        self.url = f"http://127.0.0.1:{port}"
        m = re.search(r"\(health: (http://[^/ ]+)/livez", self.lines[-1])
        self.health_url = m.group(1) if m else None

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        stop_process(self.proc, sig, 15)
        self.log.close()
        return self.proc.returncode


@contextlib.contextmanager
def served_admin(node: AdminNode | TuttiConfig, token: str = TOKEN, **app_options: Any) -> Iterator[str]:
    """The node's admin app (``create_app``'s options) under uvicorn on a free loopback port; yields
    its base URL. ``node``: an AdminNode, or the settings of a daemon run otherwise."""
    from tutti_control.app import create_app
    from tutti_control.backend import NodeBackend
    from tutti_control.serve import AdminServer, bind

    sock = bind("127.0.0.1", free_port())
    backend = NodeBackend(node if isinstance(node, TuttiConfig) else node.config)
    server = AdminServer(create_app(backend, token, **app_options), sock, backend).start()
    try:
        yield f"http://{server.address}"
    finally:
        server.stop()


def hexkey(k: int) -> str:
    return f"{k:016x}"

"""`tutti up` in cluster mode, as an operator runs it: a real process, a real etcd (or none)."""

from __future__ import annotations

import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster_fixtures import EtcdServer, cluster_secret_file, free_port, require_etcd, require_mooncake

pytestmark = pytest.mark.cluster


def free_port_pair() -> int:
    """A port p below 32767 (Mooncake's limit) such that p and p + 1 are free now."""
    rng = random.Random()
    for _ in range(200):
        p = rng.randrange(20000, 32000)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("0.0.0.0", p))
                b.bind(("0.0.0.0", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


class Up:
    """`tutti up ...`; its stderr lines are collected by a thread (``lines``). ``credential``: the
    tests' cluster credential file is passed (--cluster-secret-file)."""

    def __init__(self, tmp: Path, *argv: str, credential: bool = True) -> None:
        code = "import sys; from tutti_cluster.cli import main; sys.exit(main(sys.argv[1:]))"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TUTTI_")}
        creds = ["--cluster-secret-file", str(cluster_secret_file())] if credential else []
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "up", "--data-dir", str(tmp / "node"), "--paths", str(tmp / "ssd"),
             "--capacity-gb", "0.01", "--admin-port", "0", "--lease-ttl-s", "3", *creds, *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, text: str, timeout: float) -> str | None:
        """The first stderr line (seen so far or within ``timeout``) that contains ``text``."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.lines):
                if text in line:
                    return line
            if time.monotonic() > deadline or not self._reader.is_alive() and self.proc.poll() is not None:
                return None
            time.sleep(0.05)

    def serving(self, timeout: float = 60) -> str:
        """The line `tutti up` prints on stdout once it serves (signals stop it cleanly from then on)."""
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError("tutti up did not say it serves:\n" + "\n".join(self.lines))
        return self.proc.stdout.readline()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def test_up_with_etcd_unreachable_says_so_once_keeps_retrying_and_recovers(tmp_path: Path):
    """Nothing listens on the etcd port: one warning line says so (not DEBUG), the daemon keeps
    serving and retrying, and once etcd starts on that port the node says it answers again and
    publishes itself."""
    require_etcd()
    require_mooncake()
    etcd = EtcdServer(tmp_path)
    up = Up(tmp_path, "--etcd", etcd.endpoint, "--node-id", "up-A")
    try:
        warn = up.wait_line(f"etcd {etcd.endpoint} unreachable", 60)
        assert warn is not None, "\n".join(up.lines)
        assert warn.startswith("tutti: warning: ") and "retrying" in warn
        assert "serving: cluster" in up.serving()  # serves local engines meanwhile
        time.sleep(4)  # several keepalive periods: still one line, not one per retry
        assert sum(f"etcd {etcd.endpoint} " in line and "unreachable" in line for line in up.lines) == 1, \
            "\n".join(up.lines)
        etcd.start()
        assert up.wait_line("answers again", 10) is not None, "\n".join(up.lines)
        assert up.wait_line("node up-A published", 10) is not None, "\n".join(up.lines)
        from tutti_cluster.cluster.etcd import EtcdClient

        c = EtcdClient(etcd.endpoint)
        assert [kv.key for kv in c.get_prefix(b"tutti/n/")] == [b"tutti/n/up-A"]
        c.close()
    finally:
        rc = up.stop()
        etcd.stop()
    assert rc == 0


def test_up_refuses_to_advertise_loopback_for_an_unresolvable_etcd_host(tmp_path: Path):
    """An etcd host name that does not resolve: no silent 127.0.0.1 record, but one error line
    naming the setting; with --advertise-host the node starts and keeps retrying etcd."""
    require_mooncake()
    up = Up(tmp_path, "--etcd", "etcd.invalid:2379")
    try:
        assert up.proc.wait(60) == 2
        err = up.wait_line("tutti: error:", 1)
        assert err is not None and "etcd.invalid" in err and "--advertise-host" in err, "\n".join(up.lines)
    finally:
        up.stop()
    stage_port, te_low = free_port(), free_port_pair()
    up = Up(tmp_path, "--etcd", "etcd.invalid:2379", "--advertise-host", "127.0.0.1",
            "--stage-port", str(stage_port), "--transfer-ports", f"{te_low}-{te_low + 1}")
    try:
        warn = up.wait_line("etcd etcd.invalid:2379 unreachable", 60)
        assert warn is not None and warn.startswith("tutti: warning: "), "\n".join(up.lines)
        assert "serving: cluster" in up.serving()
        # The advertised address and the ports are the ones asked for.
        assert up.wait_line(f"stage endpoint on 127.0.0.1:{stage_port}", 1) is not None, "\n".join(up.lines)
        te = up.wait_line("tutti: transfer engine 127.0.0.1:", 1)
        assert te is not None and int(te.split(":")[2].split()[0]) in (te_low, te_low + 1), te
    finally:
        assert up.stop() == 0

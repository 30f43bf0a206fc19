"""`tutti up` serving the node's admin API (token file on first start) and the `tutti admin` client,
as real processes: the daemon and its admin API in one `tutti up`, an engine attached to it."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("fastapi", reason="the admin extra is not installed (pip install '.[admin]')")

from admin_fixtures import TuttiUp, hexkey, wait_for  # noqa: E402
from cluster_fixtures import NodeProcess, free_port  # noqa: E402


def admin(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tutti_cluster.cli", "admin", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


@pytest.fixture
def up(tmp_path: Path) -> Iterator[TuttiUp]:
    node = TuttiUp(tmp_path, free_port())
    try:
        yield node
    finally:
        node.stop()


def test_tutti_up_makes_a_private_token_once_and_serves_the_admin_api(tmp_path: Path):
    port = free_port()
    first = TuttiUp(tmp_path, port)
    token_file = first.data_dir / "admin.token"
    assert f"created in {token_file} (mode 0600)" in first.lines[-1]
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32
    r = admin("--url", first.url, "--data-dir", str(first.data_dir), "--json", "status")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["nodes"][0]["node_id"] == "cli-node"
    assert first.stop() == 0
    # The next start keeps the token; TUTTI_ADMIN_TOKEN replaces the file's.
    second = TuttiUp(tmp_path, port)
    assert second.lines[-1].endswith(f"token: in {token_file}") and token_file.read_text().strip() == token
    assert second.stop() == 0
    third = TuttiUp(tmp_path, port, {"TUTTI_ADMIN_TOKEN": "from-the-environment"})
    try:
        assert third.lines[-1].endswith("token: from TUTTI_ADMIN_TOKEN")
        r = admin("--url", third.url, "--data-dir", str(third.data_dir), "status")
        assert r.returncode == 1 and "unauthorized" in r.stderr  # the file's token is no longer it
        r = admin("--url", third.url, "status", env={"TUTTI_ADMIN_TOKEN": "from-the-environment"})
        assert r.returncode == 0 and "cli-node" in r.stdout
    finally:
        third.stop()


def test_tutti_admin_commands_against_a_node(up: TuttiUp, tmp_path: Path):
    engine = NodeProcess("engine0", "", tmp_path, paths=up.paths, capacity_gb=0.02, with_daemon=False,
                         instance="engine0", data_dir=up.data_dir)
    try:
        assert engine.attached
        keys = [0x8100 + i for i in range(4)]
        assert engine.call(op="store", keys=keys)["units"] == 4
        base = ["--url", up.url, "--data-dir", str(up.data_dir)]
        assert wait_for(lambda: json.loads(admin(*base, "--json", "status").stdout)["nodes"][0]["instances"][0]
                        ["engine_connected"], 10)

        r = admin(*base, "status")
        assert r.returncode == 0 and r.stdout.startswith("ready")
        header, _, row = r.stdout.splitlines()[1:4]
        assert header.split()[:4] == ["NODE", "MODE", "STATE", "UNITS"] and row.split()[:4] == ["cli-node", "single", "up", "4"]
        r = admin(*base, "stats")
        assert r.returncode == 0 and r.stdout.splitlines()[0].split()[:3] == ["NODE", "UNITS", "PINNED"]
        assert len(r.stdout.splitlines()) == 4 and "MEMORY" not in r.stdout  # no memory tier: no tiers' lines
        assert json.loads(admin(*base, "--json", "stats").stdout)["totals"]["units"] == 4

        r = admin(*base, "objects", "--prefix", "00000000000081")
        assert r.returncode == 0 and [line.split()[0] for line in r.stdout.splitlines()[2:]] == [hexkey(k) for k in keys]
        assert r.stdout.splitlines()[2].split()[1:5] == ["cli-node", "cli-node:", "engine0", "(storage)"]
        r = admin(*base, "--json", "objects", "--key", "8100", "--key", "dead")
        assert [o["nodes"] for o in json.loads(r.stdout)["objects"]] == [["cli-node"], []]

        r = admin(*base, "pin", "--tier", "memory", hexkey(keys[0]), "beef")
        assert r.returncode == 0
        assert {tuple(line.split()) for line in r.stdout.splitlines()[2:]} == {
            (hexkey(keys[0]), "pinned"), (hexkey(0xbeef), "absent"), (hexkey(keys[0]), "no_memory_tier")}
        assert admin(*base, "pin", "--tier", "hbm", hexkey(keys[0])).returncode == 2
        r = admin(*base, "--json", "evict", "--prefix", "00000000000081")
        assert json.loads(r.stdout)["evicted"] == 3 and json.loads(r.stdout)["pinned_kept"] == 1
        assert engine.call(op="lookup", keys=keys[:1])["local"] == 1
        r = admin(*base, "unpin", hexkey(keys[0]))
        assert r.returncode == 0 and "unpinned" in r.stdout

        r = admin(*base, "drain", "cli-node", "--mode", "all", "--wait", "10")
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[2].split()[:4] == ["cli-node", "drained", "all", "0"]
        assert engine.call(op="lookup", keys=keys[:1])["local"] == 0
        r = admin(*base, "--json", "drain", "cli-node", "--undo")
        assert json.loads(r.stdout)["drain"]["state"] == "serving"

        # Errors: a clear line on stderr and a status.
        assert admin(*base, "evict").returncode == 2
        bad = tmp_path / "wrong.token"
        bad.write_text("not-the-token\n")
        r = admin("--url", up.url, "--token-file", str(bad), "stats")
        assert r.returncode == 1 and "unauthorized" in r.stderr and "HTTP 401" in r.stderr
        r = admin(*base, "drain", "no-such-node")
        assert r.returncode == 1 and "node_not_found" in r.stderr
        r = admin("--url", f"http://127.0.0.1:{free_port()}", "--data-dir", str(up.data_dir), "status")
        assert r.returncode == 3 and "cannot reach" in r.stderr
    finally:
        engine.close()


def test_tutti_up_without_the_admin_extra_warns_and_serves_the_daemon(tmp_path: Path):
    # FastAPI made unimportable in that process only (a None entry in sys.modules fails the import).
    code = ("import sys; sys.modules['fastapi'] = None; from tutti_cluster.cli import main; "
            f"sys.exit(main(['up', '--data-dir', {str(tmp_path / 'node')!r}, '--paths', {str(tmp_path)!r}, "
            "'--capacity-gb', '0.01']))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("tutti node daemon serving"), line
        assert (tmp_path / "node" / "tutti.sock").exists() and not (tmp_path / "node" / "admin.token").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    # The hint names the admin extra in the form that fits this install (tutti_cluster.cli.install_hint).
    from tutti_cluster.cli import install_hint

    assert "admin API not served" in err and install_hint("admin") in err and "[admin]'" in err

"""What an operator meets around the store: the `tutti` commands' frictions, the node daemon's stop,
and the vLLM connector's start-up failures, warnings and fail-open setting (docs/TROUBLESHOOTING.md).

Real processes and files: `tutti up` (daemon and admin API), an engine process attached to it, the
`tutti admin` client; the connector's worker role on real vLLM config objects and a real store.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tutti(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tutti_cluster.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


# ---- packaging and hints -----------------------------------------------------------------------
def test_the_admin_extra_brings_no_test_tools() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {e.split(">")[0].split("=")[0].split("[")[0].strip().lower() for e in extras["admin"]}
    assert names.isdisjoint({"pytest", "schemathesis", "hypothesis", "mypy"}), extras["admin"]
    assert any(e.startswith("schemathesis") for e in extras["test"])  # the admin API's fuzz tests need it


def test_install_hints_fit_how_the_package_was_installed() -> None:
    from importlib import metadata

    from tutti_cluster.cli import install_hint

    assert install_hint("torch") == "pip install torch"
    try:
        direct = json.loads(metadata.distribution("tutti-cluster").read_text("direct_url.json") or "null")
    except metadata.PackageNotFoundError:
        direct = None
    hint = install_hint("admin")
    if isinstance(direct, dict) and direct.get("url", "").startswith("file://"):  # from a source tree (CI: -e .)
        editable = bool((direct.get("dir_info") or {}).get("editable"))
        src = direct["url"][len("file://"):]
        assert hint == f"pip install {'-e ' if editable else ''}'{src}[admin]'", hint
        assert (Path(src) / "pyproject.toml").exists()
    else:
        assert hint == "pip install 'tutti-cluster[admin]'"


# ---- tutti up ----------------------------------------------------------------------------------
def test_the_demo_checks_its_paths_before_any_work(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    import tutti_cluster.demo
    from tutti_cluster.cli import main

    def no_demo(*a: Any, **k: Any) -> Any:
        raise AssertionError("the demo started on a path that does not exist")

    monkeypatch.setattr(tutti_cluster.demo, "run_demo", no_demo)  # a check that it never runs, not a stand-in
    monkeypatch.setenv("TUTTI_DATA_DIR", str(tmp_path / "node"))
    assert main(["up", "--demo", "--paths", "/proc/nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tutti: error: storage path /proc/nope does not exist"), err
    afile = tmp_path / "a-file"
    afile.write_text("")
    assert main(["up", "--demo", "--paths", str(afile)]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.fixture
def up(tmp_path: Path):
    pytest.importorskip("fastapi", reason="the admin extra is not installed (pip install '.[admin]')")
    from admin_fixtures import TuttiUp
    from cluster_fixtures import free_port

    node = TuttiUp(tmp_path, free_port())
    yield node
    node.stop()


def test_a_second_tutti_up_on_a_data_directory_names_the_daemon_there(up: Any) -> None:
    r = tutti("up", "--data-dir", str(up.data_dir), "--paths", up.paths[0], "--capacity-gb", "0.05",
              "--admin-port", up.url.rsplit(":", 1)[1])
    assert r.returncode == 2
    assert f"a node daemon already serves {up.data_dir} (pid {up.proc.pid})" in r.stderr, r.stderr
    assert "Address already in use" not in r.stderr


def test_tutti_admin_is_quiet_unless_verbose(up: Any) -> None:
    base = ["admin", "--url", up.url, "--data-dir", str(up.data_dir)]
    r = tutti(*base, "status")
    assert r.returncode == 0 and "HTTP Request" not in r.stderr, r.stderr
    r = tutti("-v", *base, "status")
    assert r.returncode == 0 and "HTTP Request: GET" in r.stderr, r.stderr


def test_sigterm_ends_tutti_up_in_bounded_time_even_when_its_stop_hangs(tmp_path: Path) -> None:
    """`tutti up` with an engine attached and then hung (SIGSTOP: its connections stay open), and a
    daemon stop that never returns once done (as one waiting on an etcd that does not answer: a
    fault that cannot be caused here on demand, so the stop is wrapped): SIGTERM still ends the
    process, saying why, once the stop timeout (1 s here) has passed."""
    from cluster_fixtures import NodeProcess

    code = ("import sys, threading\n"
            "import tutti_cluster.node.daemon as d\n"
            "d.STOP_TIMEOUT_S = 1.0\n"
            "real = d.NodeDaemon.stop\n"
            "def stop(self):\n"
            "    real(self)\n"
            "    threading.Event().wait()\n"
            "d.NodeDaemon.stop = stop\n"
            "from tutti_cluster.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    data_dir, ssd = tmp_path / "node", tmp_path / "ssd"
    ssd.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", code, "up", "--data-dir", str(data_dir), "--paths", str(ssd),
                             "--capacity-gb", "0.05", "--admin-port", "0", "--health-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    engine = None
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("tutti node daemon serving")
        engine = NodeProcess("engine0", "", tmp_path, paths=[str(ssd)], capacity_gb=0.02, with_daemon=False,
                             instance="engine0", data_dir=data_dir)
        assert engine.attached
        os.kill(engine.pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)  # a bound for the test only: it ends about 1 s after the stop
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("tutti up did not end on SIGTERM") from None
        assert proc.returncode == 1, err
        assert "node daemon did not stop within 1 s" in err, err
        assert not (data_dir / "tutti.sock").exists()  # the stop did its work before it hung
    finally:
        if proc.poll() is None:
            proc.kill()
        if engine is not None:
            os.kill(engine.pid, signal.SIGCONT)
            engine.close()


# ---- the vLLM connector ------------------------------------------------------------------------
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def test_bounded_warnings_count_what_they_hold_back(caplog) -> None:
    pytest.importorskip("vllm")
    from tutti_cluster.vllm.logs import BoundedLog

    now = [0.0]
    log = logging.getLogger("tutti_cluster.vllm.test")
    caplog.set_level(logging.WARNING, logger="tutti_cluster.vllm.test")
    warn = BoundedLog(log, per_minute=3, clock=lambda: now[0])
    logged = [warn.warning("unit %d failed", i) for i in range(5)]
    assert logged == [True, True, True, False, False]
    now[0] = 61.0
    assert warn.warning("unit %d failed", 5)
    warn.warning("unit %d failed", 6)
    warn.warning("unit %d failed", 7)
    warn.warning("unit %d failed", 8)  # held back
    warn.flush()
    msgs = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert msgs == ["unit 0 failed", "unit 1 failed", "unit 2 failed",
                    "Tutti: 2 more warnings like the above in 61 s were not logged (at most 3 a minute are)",
                    "unit 5 failed", "unit 6 failed", "unit 7 failed",
                    "Tutti: 1 more warning like the above in 0 s was not logged (at most 3 a minute are)"]
    assert warn.suppressed_total == 3


def test_failure_warnings_name_each_units_key_pool_file_slot_and_cause() -> None:
    """The store's own report of each failed unit (its cause where it was found, not a guess from
    counters): a few in full, the rest counted by cause."""
    pytest.importorskip("vllm")
    from tutti_cluster.store import UnitFailure
    from tutti_cluster.vllm.logs import describe_failures

    fails = [UnitFailure(2, 0xAB, "checksum", "/mnt/a/tutti-default-r0.pool", 7, 7 * 69632),
             UnitFailure(3, 0xAC, "io_error", "/mnt/b/tutti-default-r0.pool", 1, 69632, errno=5),
             UnitFailure(4, 0xAD, "not_present"), UnitFailure(5, 0xAE, "not_present"),
             UnitFailure(6, 0xAF, "no_free_slot")]
    text = describe_failures(fails, at_most=3)
    assert text.startswith("unit 2 (key 00000000000000ab) in /mnt/a/tutti-default-r0.pool slot 7 (byte 487424): "
                           "checksum mismatch"), text
    assert "unit 3 (key 00000000000000ac) in /mnt/b/tutti-default-r0.pool slot 1 (byte 69632): I/O error on the " \
           "pool file: Input/output error (errno 5)" in text
    assert "unit 4 (key 00000000000000ad) (no slot): not in the pool (evicted or removed since the lookup)" in text
    assert text.endswith("; 2 more units (not_present: 1, no_free_slot: 1)"), text


def _worker(tmp_path: Path, paths: list[str], **extra: Any) -> Any:
    """A worker-role connector on real vLLM config objects, registering 2 layers of CPU KV."""
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tutti_cluster.vllm import TuttiConnector

    cfg = {"paths": paths, "data_dir": str(tmp_path / "node"), "unit_tokens": 64, "capacity_gb": 0.01,
           "min_io_bytes": 4096, "staging_mb": 2, "namespace": "test", **extra}
    vc = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="TuttiConnector", kv_connector_module_path="tutti_cluster.vllm", kv_role="kv_both",
        kv_load_failure_policy="recompute", kv_connector_extra_config=cfg), cache_config=CacheConfig(block_size=32))
    c = TuttiConnector(vc, KVConnectorRole.WORKER, KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[]))
    c.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(16, 2, 32, 16) for i in range(2)})
    return c, vc


@needs_vllm
def test_a_store_that_cannot_open_stops_the_engine_with_the_cause_first(tmp_path: Path, caplog) -> None:
    from tutti_cluster.errors import StorageError, TuttiError

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    caplog.set_level(logging.ERROR, logger="tutti_cluster.vllm")
    with pytest.raises(TuttiError) as e:
        _worker(tmp_path, [str(not_a_dir)])
    msg = str(e.value)
    assert isinstance(e.value, StorageError), type(e.value)
    assert msg.startswith("the Tutti KV store could not open: ") and str(not_a_dir) in msg
    assert "\n" not in msg and "on_store_error: serve_without_cache" in msg
    assert "capacity_gb per path" in msg and "pool_files" in msg
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and "could not open" in r.getMessage()]
    assert len(logged) == 1


@needs_vllm
def test_serve_without_cache_answers_no_hits_saves_nothing_and_reminds(tmp_path: Path, caplog) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tutti_cluster.vllm import Transfer, TuttiConnector, TuttiConnectorMetadata, TuttiHandshake
    from tutti_cluster.vllm.logs import Reminder

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    caplog.set_level(logging.WARNING, logger="tutti_cluster.vllm")
    c, vc = _worker(tmp_path, [str(not_a_dir)], on_store_error="serve_without_cache")
    try:
        w = c.worker
        assert w.store is None and w.store_error and str(not_a_dir) in w.store_error
        assert any("serving WITHOUT the KV cache" in r.getMessage() for r in caplog.records)
        assert isinstance(w._reminder, Reminder) and w._reminder.every_s == 60.0
        hs = c.get_handshake_metadata()
        assert isinstance(hs, TuttiHandshake) and hs.keys == [] and hs.store_error == w.store_error
        # A step: a finished request's save is done at once (its blocks go back), nothing is loaded.
        meta = TuttiConnectorMetadata(saves=[Transfer("r1", [b"h" * 32], [0, 1], finish=True)],
                                      loads=[Transfer("r2", [b"g" * 32], [2, 3])])
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)
        c.wait_for_save()
        assert c.get_block_ids_with_load_errors() == {2, 3}
        assert c.get_finished(set()) == ({"r1"}, None)
        c.clear_connector_metadata()
        # The scheduler told so looks nothing up and saves nothing.
        s = TuttiConnector(vc, KVConnectorRole.SCHEDULER)
        s.set_xfer_handshake_metadata({0: hs})
        assert s.get_num_new_matched_tokens(object(), 0) == (0, False)  # type: ignore[arg-type]
        assert s.scheduler.store_error == w.store_error and not s.scheduler.options.save
    finally:
        c.shutdown()
    assert w._reminder is None


@needs_vllm
def test_the_reminder_repeats_until_stopped(caplog) -> None:
    import threading

    from tutti_cluster.vllm.logs import Reminder

    log = logging.getLogger("tutti_cluster.vllm.test")
    caplog.set_level(logging.WARNING, logger="tutti_cluster.vllm.test")
    seen = threading.Event()

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if len([r for r in caplog.records if r.getMessage() == "no cache"]) >= 2:
                seen.set()

    h = Count()
    log.addHandler(h)
    try:
        r = Reminder(log, "no cache", every_s=0.01)
        assert seen.wait(30)
        r.stop()
        n = r.count
        assert n >= 2 and not r._thread.is_alive() and r.count == n
    finally:
        log.removeHandler(h)


@needs_vllm
def test_a_bad_on_store_error_is_a_config_error() -> None:
    from tutti_cluster.errors import ConfigError
    from tutti_cluster.vllm.config import connector_config

    assert connector_config({}, "kv_both")[1].on_store_error == "fail"
    assert connector_config({"on_store_error": "serve_without_cache"}, "kv_both")[1].on_store_error == \
        "serve_without_cache"
    with pytest.raises(ConfigError, match="on_store_error must be one of"):
        connector_config({"on_store_error": "ignore"}, "kv_both")

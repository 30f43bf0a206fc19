"""Cluster mode with >= 3 nodes as separate processes, real etcd and the real Transfer Engine (TCP).

Each node process runs the node daemon in cluster mode and one engine store attached to it
(`cluster_fixtures.NodeProcess`). KV bytes are a pure function of the unit key, so the requester
checks byte-exactness itself.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster_fixtures import EtcdServer, NodeProcess, require_etcd, require_mooncake

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LEASE_TTL = 3


@pytest.fixture
def cluster(tmp_path: Path):
    require_etcd()
    require_mooncake()
    etcd = EtcdServer(tmp_path)
    etcd.start()
    nodes: dict[str, NodeProcess] = {}
    try:
        for name in ("A", "B", "C"):
            nodes[name] = NodeProcess(name, etcd.endpoint, tmp_path, lease_ttl_s=LEASE_TTL)
        yield etcd, nodes
    finally:
        for n in nodes.values():
            n.close()
        etcd.stop()


def wait_for(pred, timeout: float, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(step)


KEYS_A = [0xA000 + i for i in range(6)]


def test_prefix_stored_on_a_is_served_byte_exact_to_b_and_c(cluster):
    _, nodes = cluster
    r = nodes["A"].call(op="store", keys=KEYS_A)
    assert r["ok"] and r["units"] == len(KEYS_A), r
    for name in ("B", "C"):
        r = wait_for(lambda: (x := nodes[name].call(op="lookup", keys=KEYS_A))["hits"] == len(KEYS_A) and x, 5)
        assert r and r["local"] == 0, f"{name} does not see A's units: {r}"
        f = nodes[name].call(op="fetch", keys=KEYS_A)
        assert f["ok"], f
        assert f["local"] == 0 and f["placed"] == len(KEYS_A), f
        assert f["exact"] == [True] * len(KEYS_A)


def test_partial_prefix_and_local_first(cluster):
    _, nodes = cluster
    # B holds the first two units itself, A holds all six: B serves 2 locally and fetches 4.
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    assert nodes["B"].call(op="store", keys=KEYS_A[:2])["ok"]
    f = nodes["B"].call(op="fetch", keys=KEYS_A + [0xDEAD])
    assert f["ok"] and f["local"] == 2 and f["lookup"] == len(KEYS_A), f
    assert f["placed"] == len(KEYS_A) - 2 and f["exact"] == [True] * len(KEYS_A)


def test_keep_replica_registers_the_copy(cluster):
    _, nodes = cluster
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    f = nodes["B"].call(op="fetch", keys=KEYS_A, keep=True)
    assert f["placed"] == len(KEYS_A) and all(f["exact"])
    assert nodes["B"].call(op="lookup", keys=KEYS_A)["local"] == len(KEYS_A)
    # With A gone, C still finds every unit: B's replicas are in the directory.
    nodes["A"].kill()
    f = wait_for(lambda: (x := nodes["C"].call(op="fetch", keys=KEYS_A))["placed"] == len(KEYS_A) and x,
                 LEASE_TTL + 5)
    assert f and all(f["exact"]), f


def test_sigkill_owner_lookups_miss_within_lease_ttl(cluster):
    _, nodes = cluster
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    assert wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS_A)["hits"] == len(KEYS_A), 5)
    nodes["A"].kill()
    t0 = time.monotonic()
    # Right after the kill the directory may still list A: a fetch must then fail soft (no error,
    # no hang) and place nothing, so the engine recomputes.
    f = nodes["B"].call(op="fetch", keys=KEYS_A, timeout=30)
    assert f["ok"], f
    assert f["placed"] == 0 and f["exact"] == []
    gone = wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS_A)["hits"] == 0, LEASE_TTL + 3)
    assert gone, "A's replicas outlived its lease"
    assert time.monotonic() - t0 < LEASE_TTL + 3
    f = nodes["C"].call(op="fetch", keys=KEYS_A)
    assert f["ok"] and f["lookup"] == 0 and f["placed"] == 0


def test_etcd_restart_with_data_loss_nodes_reregister(cluster):
    etcd, nodes = cluster
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    assert wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS_A)["hits"] == len(KEYS_A), 5)
    etcd.stop()
    # etcd down: remote lookups miss without error, local hits keep working.
    r = nodes["B"].call(op="lookup", keys=KEYS_A)
    assert r["ok"] and r["hits"] == 0
    f = nodes["A"].call(op="fetch", keys=KEYS_A)
    assert f["ok"] and f["local"] == len(KEYS_A) and all(f["exact"]) and len(f["exact"]) == len(KEYS_A)
    # A commit while etcd is away is replayed once it is back.
    extra = [0xB000, 0xB001]
    assert nodes["A"].call(op="store", keys=extra)["ok"]
    etcd.start(wipe=True)  # a replaced etcd: every lease and key is gone
    back = wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS_A)["hits"] == len(KEYS_A), LEASE_TTL * 3 + 5)
    assert back, "A did not re-register after the etcd restart"
    assert wait_for(lambda: nodes["C"].call(op="lookup", keys=extra)["hits"] == 2, 5)
    f = nodes["C"].call(op="fetch", keys=KEYS_A + extra)
    assert f["placed"] == len(KEYS_A) + 2 and all(f["exact"])


def test_etcd_restart_keeping_data(cluster):
    etcd, nodes = cluster
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    etcd.stop()
    etcd.start(wipe=False)
    assert wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS_A)["hits"] == len(KEYS_A), LEASE_TTL * 3 + 5)
    f = nodes["B"].call(op="fetch", keys=KEYS_A)
    assert f["placed"] == len(KEYS_A) and all(f["exact"])

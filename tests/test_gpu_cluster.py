"""Cluster mode with a GPU engine: a requesting CUDA engine gets units from an owner node over the
real Transfer Engine (TCP) and a real etcd, on one host.

Node A (CPU engine, its pool on the host's disk) owns the units; node B is a CUDA engine whose KV
cache is in GPU memory (`cluster_fixtures.NodeProcess`, backend "cuda"). KV bytes are a pure
function of the unit key, so B checks byte-exactness itself after copying its blocks back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster_fixtures import EtcdServer, NodeProcess, close_all, require_etcd, require_mooncake, wait_for
from test_gpu import needs_gpu
from test_cluster import damage_header

pytestmark = [*needs_gpu, pytest.mark.cluster, pytest.mark.slow]

KEYS = [0xC000 + i for i in range(6)]


@pytest.fixture
def nodes(tmp_path: Path):
    require_etcd()
    require_mooncake()
    etcd = EtcdServer(tmp_path)
    etcd.start()
    out: dict[str, NodeProcess] = {}
    try:
        out["A"] = NodeProcess("A", etcd.endpoint, tmp_path, lease_ttl_s=5)
        out["B"] = NodeProcess("B", etcd.endpoint, tmp_path, lease_ttl_s=5, backend="cuda")
        yield out
    finally:
        close_all(out.values())
        etcd.stop()


def test_remote_units_arrive_byte_exact_in_gpu_blocks_beside_local_ones(nodes):
    """B holds the first two units itself and A all six: one fetch places two local and four
    remote units, every one byte-exact in B's GPU blocks; B's daemon counts the remote ones."""
    a, b = nodes["A"], nodes["B"]
    assert a.call(op="store", keys=KEYS)["ok"]
    assert b.call(op="store", keys=KEYS[:2])["ok"]
    assert wait_for(lambda: b.call(op="lookup", keys=KEYS)["hits"] == len(KEYS), 10)
    f = b.call(op="fetch", keys=KEYS)
    assert f["ok"] and f["local"] == 2 and f["local_units"] == 2 and f["placed"] == 4, f
    assert f["exact"] == [True] * len(KEYS), f
    assert b.call(op="stats")["client"]["remote_units"] == 4


def test_corrupt_remote_unit_is_a_miss_and_the_owner_drops_it(nodes):
    """A damaged header in A's pool file: B places the units before it, byte-exact, and nothing
    after it; A stops advertising the damaged unit."""
    a, b = nodes["A"], nodes["B"]
    assert a.call(op="store", keys=KEYS)["ok"]
    assert wait_for(lambda: b.call(op="lookup", keys=KEYS)["hits"] == len(KEYS), 10)
    damage_header(Path(a.config["paths"][0]), KEYS[3])
    f = b.call(op="fetch", keys=KEYS)
    assert f["ok"] and f["placed"] == 3 and f["exact"] == [True] * 3, f
    assert wait_for(lambda: a.call(op="stats")["daemon"]["unreadable_units"] >= 1, 5)
    assert wait_for(lambda: b.call(op="lookup", keys=KEYS)["hits"] == 3, 10)


def test_a_failure_on_the_gpu_engine_is_not_reported_against_the_owner(nodes):
    """B scatters into block ids its GPU cache does not have (an error of B's own, as a device
    error would be): nothing placed, A gets no corruption report, and B's next fetch works."""
    a, b = nodes["A"], nodes["B"]
    assert a.call(op="store", keys=KEYS)["ok"]
    assert wait_for(lambda: b.call(op="lookup", keys=KEYS)["hits"] == len(KEYS), 10)
    f = b.call(op="fetch", keys=KEYS, block_base=1 << 20)
    assert f["ok"] and f["placed"] == 0, f
    st = a.call(op="stats")["daemon"]
    assert st["stage"]["corrupt_reports"] == 0 and st["unreadable_units"] == 0, st
    f = b.call(op="fetch", keys=KEYS)
    assert f["placed"] == len(KEYS) and all(f["exact"]), f

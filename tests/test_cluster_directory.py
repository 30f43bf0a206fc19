"""The etcd replica directory (`EtcdDirectory`) and its gRPC client, against a real etcd."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster_fixtures import EtcdServer, cluster_secret, etcd_server, require_etcd, wait_for  # noqa: F401 (fixture)
from tutti_cluster.cluster.directory import EtcdDirectory, NodeRecord, parse_endpoints, unit_key
from tutti_cluster.cluster.etcd import EtcdClient, EtcdError, op_put, op_range, prefix_end
from tutti_cluster.errors import ConfigError

pytestmark = pytest.mark.cluster

SECRET = cluster_secret()


def node(etcd: EtcdServer, name: str, ttl: int = 3, **kw) -> EtcdDirectory:
    d = EtcdDirectory(etcd.endpoint, name, lease_ttl_s=ttl, secret=SECRET, **kw)
    d.start(NodeRecord(name, f"seg-{name}", f"stage-{name}"))
    return d


def test_wire_helpers():
    assert prefix_end(b"tutti/u/") == b"tutti/u0"
    assert prefix_end(b"a\xff") == b"b"
    assert unit_key(-1, "n") == "tutti/u/ffffffffffffffff/n"
    assert parse_endpoints("http://h:1, k:2") == [("h", 1), ("k", 2)]
    for bad in ("", "nohost", "h:x"):
        with pytest.raises(ConfigError):
            parse_endpoints(bad)
    with pytest.raises(ConfigError):
        EtcdDirectory("127.0.0.1:1", "a/b", secret=SECRET)
    with pytest.raises(ConfigError):
        EtcdDirectory("127.0.0.1:1", "a", lease_ttl_s=1, secret=SECRET)
    with pytest.raises(TypeError):
        EtcdDirectory("127.0.0.1:1", "a")  # type: ignore[call-arg]  # never without the cluster credential


def test_client_round_trip(etcd_server):
    c = EtcdClient(etcd_server.endpoint)
    lease = c.lease_grant(5)
    c.txn([op_put(b"x/1", b"one", lease), op_put(b"x/2", b"", 0)])
    res = c.txn([op_range(b"x/1"), op_range(b"x/", prefix_end(b"x/"), keys_only=True), op_range(b"nope")])
    assert [kv.value for kv in res[0]] == [b"one"] and res[0][0].lease == lease
    assert [kv.key for kv in res[1]] == [b"x/1", b"x/2"]
    assert res[2] == []
    assert c.count_prefix(b"x/") == 2
    assert c.lease_keepalive(lease) > 0
    c.lease_revoke(lease)
    assert c.count_prefix(b"x/") == 1  # the leased key went with its lease
    assert c.lease_keepalive(lease) == 0
    c.close()


def test_register_lookup_unregister(etcd_server):
    a, b = node(etcd_server, "A"), node(etcd_server, "B")
    try:
        assert a.register([1, 2, 3, 5])
        assert b.register([1, 2])
        # Prefix lookups stop at the first key nobody holds; self is excluded unless asked for.
        assert b.lookup([1, 2, 3, 4, 5]) == [["A"], ["A"], ["A"]]
        assert [sorted(o) for o in b.lookup([1, 2, 3], exclude_self=False)] == [["A", "B"], ["A", "B"], ["A"]]
        assert b.lookup([4, 5], prefix=False) == [[], ["A"]]
        assert a.lookup([1]) == [["B"]]
        assert a.unregister([2])
        assert b.lookup([1, 2, 3]) == [["A"]]
        rec = b.node("A")
        assert rec is not None and rec.segment == "seg-A" and rec.stage == "stage-A"
        assert b.node("nobody") is None
    finally:
        a.stop()
        b.stop()


def test_batches_larger_than_a_transaction_are_split(tmp_path: Path):
    require_etcd()
    etcd = EtcdServer(tmp_path, max_txn_ops=16)  # etcd refuses transactions of more than 16 ops
    etcd.start()
    a = node(etcd, "A", max_txn_ops=16)
    b = node(etcd, "B", max_txn_ops=16)
    try:
        keys = list(range(100, 200))
        assert a.register(keys)
        assert b.lookup(keys) == [["A"]] * 100
        assert a.unregister(keys[50:])
        assert len(b.lookup(keys)) == 50
        # A client that starts above the server's limit shrinks its transactions by itself.
        big = EtcdDirectory(etcd.endpoint, "C", max_txn_ops=100, secret=SECRET)
        assert big.lookup(keys) == [["A"]] * 50
        assert big.max_txn_ops <= 16 and big.stats.lookup_errors == 0
        assert big.register(keys[:40]) is False  # C has no lease yet: queued, not an error
    finally:
        a.stop()
        b.stop()
        etcd.stop()


def test_lease_expiry_removes_a_silent_nodes_entries(etcd_server):
    a, b = node(etcd_server, "A", ttl=2), node(etcd_server, "B")
    try:
        a.register([7, 8])
        assert b.lookup([7, 8]) == [["A"], ["A"]]
        a.stop(revoke=False)  # as if the process died: no revoke, no more keepalives
        assert wait_for(lambda: b.lookup([7]) == [], 6)
        assert wait_for(lambda: b.refresh_nodes().get("A") is None, 3)
    finally:
        b.stop()


def test_keepalive_holds_entries_beyond_the_ttl(etcd_server):
    a, b = node(etcd_server, "A", ttl=2), node(etcd_server, "B")
    try:
        a.register([9])
        time.sleep(5)  # more than two TTLs
        assert b.lookup([9]) == [["A"]]
        assert a.stats.lease_renewals >= 2
    finally:
        a.stop()
        b.stop()


def test_etcd_down_lookups_miss_and_registrations_replay(etcd_server):
    a, b = node(etcd_server, "A", ttl=2), node(etcd_server, "B", ttl=2)
    try:
        a.register([1])
        etcd_server.stop()
        assert b.lookup([1]) == []
        assert b.stats.lookup_errors >= 1
        # Right after a failure the directory backs off instead of waiting on etcd again.
        assert b.lookup([1]) == [] and b.stats.lookups_skipped >= 1
        assert a.register([2, 3]) is False  # queued
        assert a.unregister([1]) is False    # queued
        etcd_server.start(wipe=True)
        assert wait_for(lambda: b.lookup([2, 3]) == [["A"], ["A"]], 10)
        assert b.lookup([1]) == []
        assert a.stats.leases_granted >= 2
    finally:
        a.stop()
        b.stop()


def test_directory_survives_a_start_without_etcd(tmp_path: Path):
    require_etcd()
    etcd = EtcdServer(tmp_path)
    a = EtcdDirectory(etcd.endpoint, "A", lease_ttl_s=2, secret=SECRET)
    a.register([42])
    a.start(NodeRecord("A", "s", "t"))  # etcd is not running yet: no error
    etcd.start()
    b = node(etcd, "B")
    try:
        assert wait_for(lambda: b.lookup([42]) == [["A"]], 10)
    finally:
        a.stop()
        b.stop()
        etcd.stop()


def test_client_errors_are_etcd_errors(tmp_path: Path):
    from cluster_fixtures import free_port

    c = EtcdClient(f"127.0.0.1:{free_port()}", timeout_s=0.5)
    with pytest.raises(EtcdError):
        c.txn([op_range(b"a")])
    with pytest.raises(EtcdError):
        c.lease_grant(5)
    c.close()


def test_bad_records_in_etcd_are_skipped_not_fatal(etcd_server):
    """Garbage under the directory's prefixes (another node's bug, a hand-made key) costs only
    itself: the other nodes' records and entries are still read, and nothing raises."""
    from tutti_cluster.cluster.directory import NODE_PREFIX, UNIT_PREFIX
    from tutti_cluster.cluster.stage_stream import StageStream, ping

    a, b = node(etcd_server, "A"), node(etcd_server, "B")
    e = EtcdDirectory(etcd_server.endpoint, "E", lease_ttl_s=3, secret=SECRET)
    e.start(NodeRecord("E", "seg-E", "not-an-address", {"pid": 1}))  # signed, with a stage address that is not host:port
    c = EtcdClient(etcd_server.endpoint)
    try:
        bad = {
            "junk": b"not json", "list": b"[1]", "num": b'{"node_id": 5}', "slash": b'{"node_id": "x/y"}',
            "other": b'{"node_id": "A", "segment": "evil:1", "stage": "evil:2"}',  # claims to be A
            "deep": b'{"node_id": "deep", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        }
        for name, value in bad.items():
            c.put((NODE_PREFIX + name).encode(), value)
        c.put(unit_key(7, "").encode() + b"\xff\xfe", b"")  # a unit entry whose node is not UTF-8
        a.register([7])
        nodes = b.refresh_nodes()
        assert sorted(nodes) == ["A", "B", "E"]
        assert nodes["A"].segment == "seg-A" and nodes["E"].extra == {"pid": 1}
        assert b.stats.bad_records == len(bad)
        assert b.lookup([7]) == [["A"]] and b.stats.bad_records == len(bad) + 1
        assert c.count_prefix(UNIT_PREFIX.encode()) == 2
        # A record's stage address that is not host:port is a failed stream, never an exception.
        s = StageStream(None, nodes["E"].stage, nodes["E"].segment, [7], timeout_s=1, secret=SECRET)  # type: ignore[arg-type]
        assert list(s) == [] and "not a host:port address" in (s.error or "")
        assert not ping("not-an-address") and not ping("h:99999")
    finally:
        c.close()
        a.stop()
        b.stop()
        e.stop()

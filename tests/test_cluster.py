"""Cluster mode with >= 3 nodes as separate processes, real etcd and the real Transfer Engine (TCP).

Each node process runs the node daemon in cluster mode and one engine store attached to it
(`cluster_fixtures.NodeProcess`). KV bytes are a pure function of the unit key, so the requester
checks byte-exactness itself.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster_fixtures import EtcdServer, NodeProcess, close_all, require_etcd, require_mooncake, wait_for

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
        close_all(nodes.values())
        etcd.stop()



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
    # A's daemon read every unit straight into its registered slots (read_unit_into), none through
    # a copy, although its slots were sized only when the engine attached.
    stage = nodes["A"].call(op="stats")["daemon"]["stage"]
    assert stage["units_staged"] == 2 * len(KEYS_A) and stage["units_copied"] == 0, stage


def test_daemon_lookup_hands_owners_to_the_fetch(cluster):
    _, nodes = cluster
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    assert nodes["C"].call(op="store", keys=KEYS_A[:2])["ok"]
    f = nodes["C"].call(op="fetch", keys=KEYS_A, via_daemon=True)
    assert f["ok"] and f["lookup"] == len(KEYS_A) and f["local"] == 2, f
    assert f["placed"] == len(KEYS_A) - 2 and f["exact"] == [True] * len(KEYS_A)
    st = nodes["C"].call(op="stats")["client"]
    assert st["remote_lookups"] == 0  # the fetch used the daemon's answer, not its own lookup


def test_remote_fetch_counters_reach_the_requesting_nodes_daemon_and_metrics(cluster):
    """The requester's remote fetches (units, bytes, fetches that ended early) travel with its
    engine's counters to its node daemon, and from there to the admin plane's /metrics."""
    _, nodes = cluster
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    missing = 0xF00D  # nobody holds it: the fetch of KEYS_A + [missing] places KEYS_A, no failure
    f = nodes["B"].call(op="fetch", keys=KEYS_A + [missing])
    assert f["placed"] == len(KEYS_A) and all(f["exact"])
    client = nodes["B"].call(op="stats")["client"]
    assert client["remote_units"] == len(KEYS_A) and client["remote_bytes"] > 0

    def reported() -> dict:
        return nodes["B"].call(op="stats")["daemon"]["instances"]["engine0"]["cluster"] or {}

    assert wait_for(lambda: reported().get("remote_units") == len(KEYS_A), 6), reported()
    assert reported()["remote_bytes"] == client["remote_bytes"] and reported()["remote_failures"] == 0
    # A fetch that ends early: the owner is gone (connection refused) before B pulls.
    assert nodes["C"].call(op="store", keys=[0xC000])["ok"]
    assert nodes["B"].call(op="lookup", keys=[0xC000])["hits"] == 1
    nodes["C"].kill()
    assert nodes["B"].call(op="fetch", keys=[0xC000])["placed"] == 0
    assert wait_for(lambda: reported().get("remote_failures") == 1, 6), reported()

    pytest.importorskip("fastapi", reason="the admin extra is not installed (pip install '.[admin]')")
    from fastapi.testclient import TestClient

    from tutti_cluster import TuttiConfig
    from tutti_control.app import create_app
    from tutti_control.backend import NodeBackend

    backend = NodeBackend(TuttiConfig(**nodes["B"].config))
    try:
        text = TestClient(create_app(backend, "t" * 32)).get("/metrics").text
    finally:
        backend.close()
    from prometheus_client.parser import text_string_to_metric_families

    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
           if s.name.startswith("tutti_remote_fetch_") and s.labels == {"node": "B", "instance": "engine0"}}
    assert got == {"tutti_remote_fetch_units_total": len(KEYS_A), "tutti_remote_fetch_bytes_total": client["remote_bytes"],
                   "tutti_remote_fetch_failures_total": 1}, got


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


def test_frozen_owner_costs_a_bounded_wait_then_expires(cluster):
    """SIGSTOP node A (a hung process: its sockets still accept, nothing answers)."""
    _, nodes = cluster
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    assert wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS_A)["hits"] == len(KEYS_A), 5)
    nodes["A"].proc.send_signal(signal.SIGSTOP)
    try:
        f = nodes["B"].call(op="fetch", keys=KEYS_A, timeout=60)
        assert f["ok"] and f["placed"] == 0
        assert wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS_A)["hits"] == 0, LEASE_TTL + 4)
    finally:
        nodes["A"].proc.send_signal(signal.SIGCONT)
    # Thawed, A finds its lease expired and registers again.
    assert wait_for(lambda: nodes["C"].call(op="lookup", keys=KEYS_A)["hits"] == len(KEYS_A), LEASE_TTL * 3 + 5)
    f = nodes["C"].call(op="fetch", keys=KEYS_A)
    assert f["placed"] == len(KEYS_A) and all(f["exact"])


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


def test_etcd_outage_of_60_s_lookups_find_remote_units_within_5_s(cluster):
    """etcd stopped for 60 s (20 lease TTLs) and started again on the same port and data dir: the
    nodes' gRPC channels reconnect within seconds (reconnect backoff capped at 2 s, not gRPC's
    120 s), the owner keeps or re-takes its lease and re-registers, and remote lookups hit again
    within 5 s of the restart (etcd's own start-up included)."""
    etcd, nodes = cluster
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    assert wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS_A)["hits"] == len(KEYS_A), 5)
    etcd.stop()
    down = time.monotonic()
    while time.monotonic() - down < 60:
        assert nodes["B"].call(op="lookup", keys=KEYS_A)["hits"] == 0  # misses, never errors
        time.sleep(1.0)
    restart = time.monotonic()
    etcd.start(wipe=False)
    # Each node's channel reconnects on its own: both requesters must see A's units within 5 s
    # (a fetch right after B's first hit once raced C's reconnect in CI-like load).
    for n in ("B", "C"):
        assert wait_for(lambda: nodes[n].call(op="lookup", keys=KEYS_A)["hits"] == len(KEYS_A),
                        max(0.1, 5.0 - (time.monotonic() - restart)), step=0.05), \
            f"remote lookups on {n} did not find A's units within 5 s of the etcd restart"
    back_s = time.monotonic() - restart
    f = nodes["C"].call(op="fetch", keys=KEYS_A)
    assert f["placed"] == len(KEYS_A) and all(f["exact"])
    print(f"remote lookups hit again {back_s:.2f} s after the etcd restart began")


def test_master_down_local_and_remote_hits_keep_working(tmp_path: Path):
    """The replica directory lives in etcd, not in the Mooncake master: losing the master (which the
    nodes are configured with, as a Mooncake deployment would be) must not cost a hit."""
    require_etcd()
    require_mooncake()
    from cluster_fixtures import MooncakeMaster

    etcd = EtcdServer(tmp_path)
    etcd.start()
    master = MooncakeMaster(tmp_path)
    master.start()
    nodes = {n: NodeProcess(n, etcd.endpoint, tmp_path, lease_ttl_s=LEASE_TTL, mooncake_master=master.address)
             for n in ("A", "B", "C")}
    try:
        assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
        master.stop(signal.SIGKILL)
        f = nodes["A"].call(op="fetch", keys=KEYS_A)
        assert f["local"] == len(KEYS_A) and all(f["exact"]) and len(f["exact"]) == len(KEYS_A)
        f = nodes["B"].call(op="fetch", keys=KEYS_A)
        assert f["placed"] == len(KEYS_A) and all(f["exact"])
        # And with etcd down as well, local hits still work.
        etcd.stop()
        f = nodes["C"].call(op="fetch", keys=KEYS_A, timeout=30)
        assert f["ok"] and f["placed"] == 0
        f = nodes["A"].call(op="fetch", keys=KEYS_A)
        assert f["local"] == len(KEYS_A) and all(f["exact"]) and len(f["exact"]) == len(KEYS_A)
    finally:
        close_all(nodes.values())
        master.stop()
        etcd.stop()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A 6 MiB tmpfs: a real file system that really runs out of space (needs root/CAP_SYS_ADMIN)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root): {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_up(directory: Path) -> None:
    """Write a file until the file system says ENOSPC."""
    with open(directory / "filler", "wb") as f:
        chunk = b"\0" * (64 << 10)
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def test_node_with_full_disk_keeps_serving_reads(tmp_path: Path, tiny_tmpfs: Path):
    require_etcd()
    require_mooncake()
    etcd = EtcdServer(tmp_path)
    etcd.start()
    ssd = tiny_tmpfs / "ssd"
    ssd.mkdir()
    # Node A keeps its pool and its daemon state on the tiny file system.
    a = NodeProcess("A", etcd.endpoint, tiny_tmpfs, lease_ttl_s=LEASE_TTL, paths=[str(ssd)], capacity_gb=0.004)
    b = NodeProcess("B", etcd.endpoint, tmp_path, lease_ttl_s=LEASE_TTL)
    try:
        assert a.call(op="store", keys=KEYS_A)["units"] == len(KEYS_A)
        fill_up(tiny_tmpfs)
        assert shutil.disk_usage(tiny_tmpfs).free < (64 << 10)
        f = b.call(op="fetch", keys=KEYS_A)
        assert f["placed"] == len(KEYS_A) and f["exact"] == [True] * len(KEYS_A), f
        f = a.call(op="fetch", keys=KEYS_A)
        assert f["local"] == len(KEYS_A) and f["exact"] == [True] * len(KEYS_A), f
        # Writes on the full node fail soft or land in the preallocated pool; reads go on either way.
        r = a.call(op="store", keys=[0xF000, 0xF001])
        assert "ok" in r
        f = b.call(op="fetch", keys=KEYS_A[:3])
        assert f["placed"] >= 1 and all(f["exact"])
        assert a.call(op="stats")["ok"]
    finally:
        b.close()
        a.close()
        etcd.stop()


def test_corrupt_unit_on_owner_is_a_miss_never_wrong_data(cluster):
    """Flip bytes inside A's pool file (a real fault on a real file): B's fetch stops at the first
    corrupt unit, reports no error, and every unit it did place is byte-exact."""
    _, nodes = cluster
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    slot = int(nodes["A"].call(op="stats")["store"]["slot_bytes"])
    pools = sorted(Path(nodes["A"].config["paths"][0]).glob("tutti-engine0*.pool"))
    assert pools
    for pool in pools:  # one or several pool files per path, slots back to back in each
        size = pool.stat().st_size
        with open(pool, "r+b") as f:
            for s in range(size // slot):
                f.seek(s * slot + slot // 2)
                b = f.read(1)
                f.seek(s * slot + slot // 2)
                f.write(bytes([b[0] ^ 0xFF]))
    f = nodes["B"].call(op="fetch", keys=KEYS_A)
    assert f["ok"] and f["lookup"] == len(KEYS_A)  # the directory still lists them
    assert f["placed"] == 0 and f["exact"] == []
    # B reported the unit; A verified its copy and stopped advertising it.
    assert wait_for(lambda: nodes["A"].call(op="stats")["daemon"]["unreadable_units"] >= 1, 5)
    assert nodes["C"].call(op="lookup", keys=KEYS_A)["hits"] == 0


def test_a_failure_of_the_requester_is_not_reported_against_the_owner(cluster):
    """B places remote units into block ids its KV cache does not have (a real error of B's own,
    as a device error would be): nothing is placed, yet A is not told its healthy units are
    corrupt, and B neither forgets A nor stops finding its units."""
    _, nodes = cluster
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    assert wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS_A)["hits"] == len(KEYS_A), 5)
    f = nodes["B"].call(op="fetch", keys=KEYS_A, block_base=1 << 20)
    assert f["ok"] and f["placed"] == 0, f
    assert nodes["B"].call(op="stats")["client"]["remote_failures"] >= 1
    a = nodes["A"].call(op="stats")["daemon"]
    assert a["stage"]["corrupt_reports"] == 0 and a["unreadable_units"] == 0, a
    assert nodes["C"].call(op="lookup", keys=KEYS_A)["hits"] == len(KEYS_A)
    f = nodes["B"].call(op="fetch", keys=KEYS_A)
    assert f["placed"] == len(KEYS_A) and all(f["exact"]), f


HEADER_MAGIC = (0x31495454554E4B56).to_bytes(8, "little")  # b"VKNUTTI1", the first field of a slot header
HEADER_KEY_OFFSET = 16  # magic u64, version u32, num_objs u32, then the key (native/src/header.h, HeaderFixed)


def damage_header(pool_dir: Path, key: int) -> Path:
    """Flip bytes inside the on-disk header of ``key``'s slot (past the key field, so the header
    no longer verifies); returns the pool file it was in."""
    for pool in sorted(pool_dir.glob("tutti-engine0*.pool")):
        data = pool.read_bytes()
        at = data.find(HEADER_MAGIC)
        while at >= 0:
            if int.from_bytes(data[at + HEADER_KEY_OFFSET:at + HEADER_KEY_OFFSET + 8], "little") == key:
                with open(pool, "r+b") as f:
                    f.seek(at + 40)  # commit_seq and obj_bytes
                    f.write(bytes(b ^ 0x5A for b in data[at + 40:at + 56]))
                    f.flush()
                    os.fsync(f.fileno())
                return pool
            at = data.find(HEADER_MAGIC, at + 1)
    raise AssertionError(f"no header of key {key:x} in {pool_dir}")


def test_unit_with_a_damaged_header_is_unregistered_by_its_owner(cluster):
    """A real damaged header in A's pool file: A's daemon cannot read the unit, so B's fetch places
    nothing before it (never wrong data), and A stops advertising it, so that C's lookups miss it
    instead of asking A again; the units after it stay advertised and are served."""
    _, nodes = cluster
    assert nodes["A"].call(op="store", keys=KEYS_A)["ok"]
    assert wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS_A)["hits"] == len(KEYS_A), 5)
    damage_header(Path(nodes["A"].config["paths"][0]), KEYS_A[2])
    f = nodes["B"].call(op="fetch", keys=KEYS_A)
    assert f["ok"] and f["placed"] == 2 and all(f["exact"]) and len(f["exact"]) == 2
    assert wait_for(lambda: nodes["C"].call(op="lookup", keys=KEYS_A)["hits"] == 2, 5)
    st = nodes["A"].call(op="stats")["daemon"]
    assert st["unreadable_units"] >= 1 and st["directory"]["unregistered"] >= 1
    f = nodes["C"].call(op="fetch", keys=KEYS_A[3:])
    assert f["placed"] == len(KEYS_A) - 3 and all(f["exact"])


def test_eviction_removes_the_registration(tmp_path: Path):
    """LRU eviction on the owner (a small pool) and explicit removal both drop the directory entry."""
    require_etcd()
    require_mooncake()
    etcd = EtcdServer(tmp_path)
    etcd.start()
    # 0.004 GiB holds 8 units of this geometry: storing 12 evicts the 4 oldest.
    a = NodeProcess("A", etcd.endpoint, tmp_path, lease_ttl_s=LEASE_TTL, capacity_gb=0.004)
    b = NodeProcess("B", etcd.endpoint, tmp_path, lease_ttl_s=LEASE_TTL)
    try:
        first, second = KEYS_A, [0xE000 + i for i in range(6)]
        assert a.call(op="store", keys=first)["units"] == len(first)
        assert wait_for(lambda: b.call(op="lookup", keys=first)["hits"] == len(first), 5)
        assert a.call(op="store", keys=second)["units"] == len(second)
        st = a.call(op="stats")["store"]
        assert st["evictions"] == len(first) + len(second) - st["total_slots"] > 0
        assert a.call(op="lookup", keys=first)["local"] == 0  # the oldest unit went first
        assert wait_for(lambda: b.call(op="lookup", keys=first)["hits"] == 0, 5)
        assert b.call(op="lookup", keys=second)["hits"] == len(second)
        assert a.call(op="evict", keys=second[3:4])["removed"] == [True]
        assert wait_for(lambda: b.call(op="lookup", keys=second)["hits"] == 3, 5)
        f = b.call(op="fetch", keys=second)
        assert f["placed"] == 3 and all(f["exact"])
    finally:
        b.close()
        a.close()
        etcd.stop()

"""The cluster plane under attack: peers without the cluster credential, real processes throughout.

One shared cluster (a real etcd, two real node processes, each a node daemon in cluster mode with
its Transfer Engine over TCP and an engine store attached, tests/cluster_fixtures.py) and, for the
handshake's bounds, a StageServer in this process. The attacker talks to the owner's stage port
over raw sockets and writes straight into etcd with the real etcd client. Each attack must be
refused and counted, with nothing staged (the owner's stage counters: no stream, no unit read) and
nothing believed (lookups do not return a forged owner, fetches never go to a forged address).

Before the cluster credential existed, every one of these attacks succeeded: the stage endpoint
answered any connection's stage request with the units' slot addresses, and lookups returned any
owner written into etcd.

The shared cluster also serves the remote read of a unit held in its owner's memory tier only (node
B keeps what it stores in memory), damaged there too.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from cluster_fixtures import (EtcdServer, NodeProcess, StageConn, close_all, cluster_secret,
                              engines, require_etcd, require_mooncake, wait_for)  # noqa: F401 (fixture: engines)
from tutti_cluster.errors import ConfigError, StorageError

pytestmark = pytest.mark.cluster

UNIT = 64 << 10  # the in-process StageServer's units (raw bytes)
KEYS = [0xA17E_0000 + i for i in range(4)]  # stored on node A
SECRET = cluster_secret()


# ---- the shared cluster -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """etcd, node A holding KEYS, node B (a requester, whose node keeps what it stores in its memory
    tier only, on /dev/shm where the host has it); A's stage address."""
    require_etcd()
    require_mooncake()
    tmp = tmp_path_factory.mktemp("auth")
    etcd = EtcdServer(tmp)
    etcd.start()
    nodes: list[NodeProcess] = []
    mem = Path(tempfile.mkdtemp(prefix="tutti-mem-", dir="/dev/shm")) if os.path.isdir("/dev/shm") else None
    tier = {"memory_paths": [str(mem)], "memory_capacity_gb": 0.01, "write_policy": "memory_only"} if mem else {}
    try:
        a = NodeProcess("A", etcd.endpoint, tmp, lease_ttl_s=5)
        nodes.append(a)
        b = NodeProcess("B", etcd.endpoint, tmp, lease_ttl_s=5, extra=tier)
        nodes.append(b)
        r = a.call(op="store", keys=KEYS)
        assert r["ok"] and r["units"] == len(KEYS), r
        assert wait_for(lambda: b.call(op="lookup", keys=KEYS)["hits"] == len(KEYS), 10)
        stage = a.call(op="stats")["daemon"]["stage_address"]
        yield etcd, a, b, stage
    finally:
        close_all(nodes)
        etcd.stop()
        if mem is not None:
            shutil.rmtree(mem, ignore_errors=True)


def stage_stats(node: NodeProcess) -> dict:
    return node.call(op="stats")["daemon"]["stage"]


def nothing_staged(before: dict, after: dict) -> bool:
    """No stream ran and no unit was read into a slot (so no slot was lent) between the two."""
    return all(after[k] == before[k] for k in ("streams", "units_staged", "bytes_staged", "misses", "reclaimed_slots"))


def refused(c: StageConn) -> bool:
    """The owner's answer to a connection that did not authenticate: one error line, then the end."""
    line = c.f.readline()
    return json.loads(line) == {"error": "authentication failed"} and c.f.readline() == b""


def wait_refusals(node: NodeProcess, before: dict, n: int) -> dict:
    """The owner's stage counters once it has counted ``n`` more refused handshakes."""
    got = wait_for(lambda: (s := stage_stats(node))["auth_failures"] >= before["auth_failures"] + n and s, 10)
    assert got, f"fewer than {n} refusals counted"
    assert got["auth_failures"] == before["auth_failures"] + n, got
    return got


# ---- the stage endpoint ---------------------------------------------------------------------------------

def test_a_credential_holder_is_served(cluster):
    """The baseline the attacks are measured against: B (holding the credential) fetches A's units
    byte-exact, and A counts the streams and units it staged for it."""
    _, a, b, _ = cluster
    before = stage_stats(a)
    f = b.call(op="fetch", keys=KEYS)
    assert f["ok"] and f["placed"] == len(KEYS) and f["exact"] == [True] * len(KEYS), f
    after = stage_stats(a)
    assert after["units_staged"] == before["units_staged"] + len(KEYS)
    assert after["handshakes"] > before["handshakes"] and after["auth_failures"] == before["auth_failures"]


@pytest.mark.parametrize("first", [
    {"op": "stage", "keys": KEYS, "window": 2},  # the request an unauthenticated client used to get served
    {"op": "ping"},
    {"op": "done", "addr": 4096},
    {"op": "corrupt", "key": KEYS[0]},
    {"op": "auth", "nonce": "00" * 32},  # no proof
    {"op": "auth", "nonce": "00" * 32, "proof": "zz" * 32},  # not hex
    {"op": "auth", "nonce": "00" * 32, "proof": "00" * 32, "keys": KEYS},  # extra fields
    {"op": "auth", "nonce": "00" * 32, "proof": "00" * 32},  # well-formed, and wrong
], ids=["stage", "ping", "done", "corrupt", "no-proof", "not-hex", "extra", "zero-proof"])
def test_an_unauthenticated_client_is_refused_before_any_request(cluster, first):
    """Whatever a client without the credential sends first, the owner answers one error and closes;
    the request never reaches the stage code (no stream, no unit read, no corrupt report)."""
    _, a, _, stage = cluster
    before = stage_stats(a)
    c = StageConn(stage, secret=None)
    try:
        assert c.hello is not None and c.hello["hello"] == "tutti-stage/1" and len(c.hello["nonce"]) == 64
        c.send(first)
        c.send({"op": "stage", "keys": KEYS, "window": 2})  # and the request, right behind it
        assert refused(c)
    finally:
        c.close()
    after = wait_refusals(a, before, 1)
    assert nothing_staged(before, after) and after["corrupt_reports"] == before["corrupt_reports"]


def test_garbage_and_an_overlong_first_line_are_refused(cluster):
    _, a, _, stage = cluster
    before = stage_stats(a)
    for line in (b"\xff\xfe not json", b"[" * 5000, b'{"op": "auth", "nonce": "' + b"0" * 4000 + b'"}'):
        c = StageConn(stage, secret=None)
        try:
            c.send(line)
            assert refused(c)
        finally:
            c.close()
    assert nothing_staged(before, wait_refusals(a, before, 3))


def test_a_client_with_a_wrong_credential_is_refused(cluster, engines):
    """Another cluster's credential: the handshake fails on both sides (raw, and through the real
    requester code, whose stream ends with an error and yields nothing)."""
    from tutti_cluster.cluster.auth import AuthError, ClusterSecret
    from tutti_cluster.cluster.stage_stream import StageStream, ping

    _, a, _, stage = cluster
    wrong = ClusterSecret.generate()
    before = stage_stats(a)
    with pytest.raises(AuthError, match="refused our cluster credential"):
        StageConn(stage, secret=wrong)
    _, requester = engines
    stream = StageStream(requester, stage, "127.0.0.1:1", KEYS, timeout_s=3, secret=wrong)
    assert list(stream) == [] and "authentication" in (stream.error or ""), stream.error
    assert not ping(stage, secret=wrong) and ping(stage, secret=SECRET)
    assert nothing_staged(before, wait_refusals(a, before, 3))


def test_a_replayed_handshake_and_session_are_refused(cluster):
    """A legitimate requester's whole session is captured (its auth line and its stage request, as a
    sniffer on the pod network sees them) and sent again on a new connection: the owner's nonce is
    new, so the captured proof is wrong and nothing is staged for the replay."""
    from tutti_cluster.cluster.auth import REQUESTER, new_nonce
    from tutti_cluster.cluster.stage_wire import AuthOp, StageOp

    _, a, _, stage = cluster
    c = StageConn(stage, secret=None)  # the legitimate requester, speaking the protocol by hand
    mine = new_nonce()
    auth = AuthOp(nonce=mine.hex(), proof=SECRET.prove(REQUESTER, bytes.fromhex(c.hello["nonce"]), mine).hex()).line()
    request = StageOp(keys=KEYS[:1], window=1).line()
    c.send(auth)
    assert "proof" in c.recv()  # the owner proved itself back
    c.send(request)
    announced = c.recv()
    assert announced["key"] == KEYS[0]
    c.send({"op": "done", "addr": announced["addr"]})
    assert c.recv() == {"end": True}
    c.close()
    before = stage_stats(a)
    for _ in range(2):  # replayed twice: the capture is worth nothing on any later connection
        r = StageConn(stage, secret=None)
        try:
            assert r.hello["nonce"] != c.hello["nonce"]
            r.send(auth)
            r.send(request)
            assert refused(r)
        finally:
            r.close()
    assert nothing_staged(before, wait_refusals(a, before, 2))


def test_a_requester_never_talks_to_an_owner_without_the_credential(engines):
    """An impostor at an owner's address (it sends a hello and accepts any proof, but cannot prove
    the credential back): the requester ends its stream with an error and never sends its request
    (the keys it wants stay its own)."""
    from tutti_cluster.cluster.stage_stream import StageStream
    from tutti_cluster.cluster.stage_wire import Hello, Welcome

    heard: list[bytes] = []
    srv = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{srv.getsockname()[1]}"

    def impostor() -> None:
        conn, _ = srv.accept()
        with conn:
            f = conn.makefile("rwb")
            f.write(Hello(nonce="ab" * 32).line())
            f.flush()
            heard.append(f.readline())  # the requester's auth line
            f.write(Welcome(proof="cd" * 32).line())
            f.flush()
            conn.settimeout(2)
            try:
                while line := f.readline():
                    heard.append(line)
            except OSError:
                pass

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    owner, requester = engines
    try:
        stream = StageStream(requester, addr, owner.segment, KEYS, timeout_s=3, secret=SECRET)
        assert list(stream) == [] and "did not prove" in (stream.error or ""), stream.error
        t.join(5)
        assert len(heard) == 1 and b'"auth"' in heard[0], heard  # no stage request followed
    finally:
        srv.close()


MEM_KEYS = [0x3E30_0000 + i for i in range(3)]  # stored on node B, in its memory tier only
HEADER_MAGIC = (0x31495454554E4B56).to_bytes(8, "little")  # b"VKNUTTI1", a slot header's first field
HEADER_KEY_OFFSET = 16  # magic u64, version u32, num_objs u32, then the key (native/src/header.h)


def test_a_unit_in_the_owners_memory_tier_only_is_served_and_a_damaged_copy_is_a_miss(cluster):
    """The cluster sees the memory tier: B's units live in its memory tier alone (memory_only), and
    A fetches them byte-exact from B's stage endpoint, which reads them through B's daemon's view of
    that tier; units committed right after that view's last rescan are served too (they once were
    a miss for 0.2 s after every rescan). Then an object of one of B's memory copies is damaged in
    the tmpfs pool file: A's fetch places the units before it and stops there (A's own checksum
    check rejects it, never wrong bytes), B is told, verifies its copy and stops advertising it."""
    _, a, b, _ = cluster
    if not b.config.get("memory_paths"):
        pytest.skip("no /dev/shm (tmpfs) for node B's memory tier")
    before = b.call(op="stats")["daemon"]
    placed: list[int] = []
    for batch in (MEM_KEYS[:1], MEM_KEYS[1:]):  # the first fetch makes B's view rescan; the second follows it
        r = b.call(op="store", keys=batch)
        assert r["ok"] and r["units"] == len(batch), r
        placed += batch
        assert wait_for(lambda: a.call(op="lookup", keys=placed)["hits"] == len(placed), 10, step=0.01)
        f = a.call(op="fetch", keys=placed)
        assert f["ok"] and f["local"] == 0 and f["placed"] == len(placed), f
        assert f["exact"] == [True] * len(placed), f
    assert b.call(op="tiers", keys=MEM_KEYS)["tiers"] == ["memory"] * len(MEM_KEYS)
    after = b.call(op="stats")["daemon"]
    assert after["stage"]["units_staged"] == before["stage"]["units_staged"] + 1 + len(MEM_KEYS), after["stage"]
    view = after["instances"]["engine0"]["view"]  # B's daemon found them in its view of the memory tier
    assert view["memory_units"] == view["units"] == len(MEM_KEYS), view

    # Damage an object of MEM_KEYS[1]'s memory copy: its slot's middle, well past the header.
    slot = int(b.call(op="stats")["store"]["slot_bytes"])
    damaged = 0
    for pool in sorted(Path(b.config["memory_paths"][0]).glob("tutti-engine0*.pool")):
        data = pool.read_bytes()
        at = data.find(HEADER_MAGIC)
        while at >= 0:
            if int.from_bytes(data[at + HEADER_KEY_OFFSET:at + HEADER_KEY_OFFSET + 8], "little") == MEM_KEYS[1]:
                mid = at + slot // 2
                with open(pool, "r+b") as fh:
                    fh.seek(mid)
                    fh.write(bytes(x ^ 0xFF for x in data[mid:mid + 8]))
                damaged += 1
            at = data.find(HEADER_MAGIC, at + 1)
    assert damaged == 1
    f = a.call(op="fetch", keys=MEM_KEYS)
    assert f["ok"] and f["placed"] == 1 and f["exact"] == [True], f
    # A's checksum check rejected the unit and A reported it (B's read checks only the header);
    # B verified its copy and stopped advertising it.
    got = wait_for(lambda: (d := b.call(op="stats")["daemon"])["unreadable_units"] > after["unreadable_units"] and d, 5)
    assert got and got["stage"]["corrupt_reports"] == after["stage"]["corrupt_reports"] + 1, got
    assert wait_for(lambda: a.call(op="lookup", keys=MEM_KEYS)["hits"] == 1, 5)


def test_the_stage_endpoint_listens_on_its_advertised_address_only(cluster):
    """The node advertises 127.0.0.1 (the route to etcd) and its stage endpoint listens there, not
    on every interface (read from the kernel's socket table, as ``ss -ltn`` shows it)."""
    _, _, _, stage = cluster
    host, port = stage.rsplit(":", 1)
    assert host == "127.0.0.1"
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                ip, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == int(port):  # LISTEN
                    listening.add(ip)
    assert listening == {"0100007F"}, listening  # 127.0.0.1 alone: no 0.0.0.0, no [::]


# ---- the handshake's bounds (a StageServer in this process, with small limits) -------------------------

def test_silent_and_trickling_connections_are_cut_after_the_handshake_time(engines):
    """A connection that never authenticates holds a thread for auth_timeout_s at most, however it
    paces its bytes; beyond max_handshakes at once, new connections are refused at once."""
    from tutti_cluster.cluster.stage import StageServer

    owner, _ = engines
    srv = StageServer(owner, {1: os.urandom(UNIT)}.get, secret=SECRET, auth_timeout_s=1.0, max_handshakes=3).start()
    try:
        silent = StageConn(srv.address, secret=None)
        trickle = StageConn(srv.address, secret=None)
        done = threading.Event()

        def drip() -> None:
            for b in b'{"op": "auth", "nonce": "' + b"0" * 64:
                if done.is_set():
                    return
                try:
                    trickle.sock.sendall(bytes([b]))
                except OSError:
                    return
                time.sleep(0.1)  # each byte well within a read timeout of 1 s

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        third = StageConn(srv.address, secret=None)
        # Three in their handshake: a fourth is closed at once (its hello may not even come).
        extra = socket.create_connection(srv.address.rsplit(":", 1), timeout=5)
        extra.settimeout(5)
        t0 = time.monotonic()
        assert extra.recv(100) in (b"", b'{"error":"authentication failed"}\n')
        extra.close()
        assert refused(silent) and refused(trickle) and refused(third)
        assert time.monotonic() - t0 < 5  # about auth_timeout_s, not the trickle's 9 s
        done.set()
        for c in (silent, trickle, third):
            c.close()
        assert srv.stats.auth_failures == 4 and srv.stats.streams == 0
        assert StageConn(srv.address).ask_ping()  # the slots for handshakes are free again
    finally:
        srv.stop()


def test_refusals_are_logged_rate_limited(engines, caplog):
    """Every refusal is counted; the log gets one warning for a burst, not one per connection."""
    from tutti_cluster.cluster.stage import StageServer

    owner, _ = engines
    srv = StageServer(owner, {}.get, secret=SECRET).start()
    try:
        with caplog.at_level("WARNING", logger="tutti_cluster.cluster.stage"):
            for _ in range(20):
                c = StageConn(srv.address, secret=None)
                c.send({"op": "stage", "keys": [1]})
                assert refused(c)
                c.close()
            assert wait_for(lambda: srv.stats.auth_failures == 20, 5)
        warnings = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(warnings) == 1 and "unauthenticated" in warnings[0].getMessage()
    finally:
        srv.stop()


def test_rotation_accepts_both_secrets_while_both_are_listed(engines):
    """During a rotation the file lists the new secret first and the old one after: such an owner
    serves requesters holding either, and records signed with either verify."""
    from tutti_cluster.cluster.auth import ClusterSecret
    from tutti_cluster.cluster.stage import StageServer
    from tutti_cluster.cluster.stage_stream import ping

    old, new = ClusterSecret.generate(), ClusterSecret.generate()
    both = ClusterSecret([new._keys[0], old._keys[0]], "rotating")
    owner, _ = engines
    srv = StageServer(owner, {}.get, secret=both).start()
    try:
        assert ping(srv.address, secret=old) and ping(srv.address, secret=new) and ping(srv.address, secret=both)
        assert not ping(srv.address, secret=ClusterSecret.generate())
    finally:
        srv.stop()
    key = b"tutti/u/0000000000000001/A"
    assert both.unit_ok(old.sign_unit(key, 7), key, 7) and both.unit_ok(new.sign_unit(key, 7), key, 7)
    assert not new.unit_ok(old.sign_unit(key, 7), key, 7)
    assert not both.unit_ok(old.sign_unit(key, 7), key, 8)  # another lease


# ---- the directory ------------------------------------------------------------------------------------

def test_forged_unit_entries_are_not_believed(cluster):
    """An etcd writer without the credential claims keys for node A (empty values, random values,
    A's valid signature of another key pasted on, under A's own lease) and for a node of its own:
    lookups (in this process and B's) ignore and count them; only A's real entries are owners."""
    from tutti_cluster.cluster.directory import EtcdDirectory, unit_key
    from tutti_cluster.cluster.etcd import EtcdClient, op_delete

    etcd, a, b, _ = cluster
    c = EtcdClient(etcd.endpoint)
    reader = EtcdDirectory(etcd.endpoint, "reader", secret=SECRET)
    fake_keys = [0xF0F0_0000 + i for i in range(4)]
    try:
        real = c.get_prefix(unit_key(KEYS[0], "A").encode())
        assert len(real) == 1 and len(real[0].value) == 16 and real[0].lease
        lease, sig = real[0].lease, real[0].value
        c.put(unit_key(fake_keys[0], "A").encode(), b"", lease=lease)  # as the directory wrote them before
        c.put(unit_key(fake_keys[1], "A").encode(), os.urandom(16), lease=lease)
        c.put(unit_key(fake_keys[2], "A").encode(), sig, lease=lease)  # A's signature of another key
        c.put(unit_key(fake_keys[3], "Z").encode(), os.urandom(16))  # a node of the attacker's own
        c.put(unit_key(KEYS[1], "Z").encode(), b"")  # Z claims one of A's keys too
        assert reader.lookup(fake_keys, prefix=False) == [[]] * 4
        assert reader.lookup(KEYS) == [["A"]] * len(KEYS)  # the real owner only: no "Z"
        assert reader.stats.unverified == 5
        r = b.call(op="lookup", keys=fake_keys)
        assert r["ok"] and r["hits"] == 0, r
        f = b.call(op="fetch", keys=KEYS)
        assert f["placed"] == len(KEYS) and f["exact"] == [True] * len(KEYS), f
    finally:
        forged = [*((k, "A") for k in fake_keys[:3]), (fake_keys[3], "Z"), (KEYS[1], "Z")]
        c.txn([op_delete(unit_key(k, n).encode()) for k, n in forged])
        reader.stop(revoke=False)
        c.close()


def test_forged_node_records_never_point_requesters_elsewhere(cluster):
    """Node records written without the credential (a node of the attacker's own with stolen-looking
    entries, a real node's record with its stage address changed, an old record of a node put back
    after its restart): none is believed, and B never connects to the attacker's address."""
    from tutti_cluster.cluster.directory import NODE_PREFIX, EtcdDirectory, NodeRecord, unit_key
    from tutti_cluster.cluster.etcd import EtcdClient, EtcdError, op_delete

    etcd, _, b, _ = cluster
    trap = socket.create_server(("127.0.0.1", 0))  # the attacker's "stage endpoint"
    trap.settimeout(0.2)
    evil = f"127.0.0.1:{trap.getsockname()[1]}"
    c = EtcdClient(etcd.endpoint)
    reader = EtcdDirectory(etcd.endpoint, "reader2", secret=SECRET)
    victim = EtcdDirectory(etcd.endpoint, "V", lease_ttl_s=5, secret=SECRET)
    keys = [0xBAD0_0000 + i for i in range(3)]
    try:
        # 1. A node of the attacker's own, with a well-formed record and entries for keys it does not hold.
        c.put((NODE_PREFIX + "Z").encode(), NodeRecord("Z", "127.0.0.1:1", evil, {"pid": 1}).to_json().encode())
        for k in keys:
            c.put(unit_key(k, "Z").encode(), b"")
        assert "Z" not in reader.refresh_nodes() and reader.lookup(keys) == []
        r = b.call(op="fetch", keys=keys)
        assert r["ok"] and r["lookup"] == 0 and r["placed"] == 0, r
        # 2. A real node's record, its stage address changed (its signature kept).
        victim.start(NodeRecord("V", "127.0.0.1:2", "127.0.0.1:3"))
        node_key = (NODE_PREFIX + "V").encode()
        (kv,) = c.get_prefix(node_key)
        signed, lease = kv.value, kv.lease
        assert reader.node("V") is not None and reader.node("V").stage == "127.0.0.1:3"
        d = json.loads(signed)
        d["stage"] = evil
        c.put(node_key, json.dumps(d).encode(), lease=lease)
        assert reader.refresh_nodes().get("V") is None
        # 3. The node restarts (a new lease): its old, validly signed record cannot come back.
        victim.stop(revoke=True)
        victim = EtcdDirectory(etcd.endpoint, "V", lease_ttl_s=5, secret=SECRET)
        victim.start(NodeRecord("V", "127.0.0.1:2", "127.0.0.1:4"))
        with pytest.raises(EtcdError):
            c.put(node_key, signed, lease=lease)  # etcd refuses a put under the old, revoked lease
        c.put(node_key, signed)  # without a lease: the signature names the old one
        assert reader.refresh_nodes().get("V") is None
        unverified = reader.stats.unverified
        assert unverified >= 3, reader.stats
        with pytest.raises(socket.timeout):
            trap.accept()  # nobody was sent to the attacker's address
    finally:
        c.txn([op_delete((NODE_PREFIX + "Z").encode())] + [op_delete(unit_key(k, "Z").encode()) for k in keys])
        victim.stop(revoke=True)
        reader.stop(revoke=False)
        c.close()
        trap.close()


# ---- the credential ------------------------------------------------------------------------------------

def _tutti(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`tutti ARGV` in a process of its own (without the caller's TUTTI_* variables), run to its end."""
    code = "import sys; from tutti_cluster.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUTTI_")}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_cluster_mode_needs_the_credential_and_says_how_to_make_one(tmp_path: Path):
    r = _tutti("up", "--data-dir", str(tmp_path / "n"), "--etcd", "127.0.0.1:1", "--admin-port", "0")
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "cluster_secret_file" in err[0] and "tutti cluster-key" in err[0], r.stderr


@pytest.mark.parametrize("case", ["group-readable", "world-readable", "short", "empty", "fifo", "directory",
                                  "missing", "huge"])
def test_a_bad_credential_file_is_a_config_error_naming_it(tmp_path: Path, case: str):
    from tutti_cluster.cluster.auth import ClusterSecret

    path = tmp_path / "cluster.key"
    if case == "fifo":
        os.mkfifo(path, 0o600)  # opening it must not hang
    elif case == "directory":
        path.mkdir(mode=0o700)
    elif case != "missing":
        content = {"short": b"0123456789abcdef\n", "empty": b"\n\n", "huge": b"a" * (65 << 10)}.get(case, b"f" * 64)
        path.write_bytes(content)
        path.chmod({"group-readable": 0o640, "world-readable": 0o604}.get(case, 0o600))
    with pytest.raises(ConfigError) as e:
        ClusterSecret.from_file(path)
    assert str(path) in str(e.value)
    if case.endswith("readable"):
        assert ("0640" if case == "group-readable" else "0604") in str(e.value)


def test_a_symlinked_credential_is_read_and_lines_are_secrets(tmp_path: Path):
    """A Kubernetes Secret volume mounts its files as symbolic links: the target's mode counts."""
    from tutti_cluster.cluster.auth import ClusterSecret

    target = tmp_path / "..data" / "cluster.key"
    target.parent.mkdir()
    target.write_bytes(b"a" * 64 + b"\n\n  " + b"b" * 40 + b"  \n")
    target.chmod(0o400)
    link = tmp_path / "cluster.key"
    link.symlink_to(target)
    s = ClusterSecret.from_file(link)
    assert s._keys == (b"a" * 64, b"b" * 40) and "a" * 10 not in repr(s)


def test_cluster_key_writes_an_owner_only_file_and_never_over_anything(tmp_path: Path):
    r = _tutti("cluster-key", str(tmp_path / "k"))
    assert r.returncode == 0, r.stderr
    st = (tmp_path / "k").stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and len((tmp_path / "k").read_text().strip()) == 64
    from tutti_cluster.cluster.auth import ClusterSecret, write_secret_file

    ClusterSecret.from_file(tmp_path / "k")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "planted").symlink_to(victim)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("k", "planted", "dangling"):
        r = _tutti("cluster-key", str(tmp_path / name))
        assert r.returncode == 2 and "already exists" in r.stderr, r.stderr
    assert victim.read_text() == "keep me" and not (tmp_path / "nowhere").exists()
    with pytest.raises(StorageError):
        write_secret_file(tmp_path / "planted")


def test_a_single_node_makes_its_credential_on_first_start(tmp_path: Path):
    """`tutti up` without etcd makes <data_dir>/cluster.key (0600) once; later starts keep it."""
    import signal

    code = "import sys; from tutti_cluster.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUTTI_")}
    key = tmp_path / "n" / "cluster.key"
    seen = []
    for _ in range(2):
        p = subprocess.Popen([sys.executable, "-c", code, "up", "--data-dir", str(tmp_path / "n"), "--paths",
                              str(tmp_path / "ssd"), "--capacity-gb", "0.01", "--admin-port", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert p.stdout is not None and "serving" in p.stdout.readline()
            assert wait_for(key.exists, 5)
        finally:
            p.send_signal(signal.SIGINT)
            p.wait(20)
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        seen.append(key.read_bytes())
    assert seen[0] == seen[1] and len(seen[0].strip()) == 64

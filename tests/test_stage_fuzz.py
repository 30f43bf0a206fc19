"""The stage endpoint (the owner's TCP port that remote requesters talk to) under malformed input.

A real StageServer on a real Mooncake Transfer Engine (TCP), spoken to over a raw socket as an
attacker would: every malformed line gets one error answer of one shape and the connection stays
usable; nothing is leaked (every slot lent comes back), the server keeps serving other requesters,
and a requester facing an owner that answers garbage ends its stream with an error, never an
exception or a unit it did not ask for. Hypothesis generates the lines.

Every connection here first proves the cluster credential (the tests' shared one), as a
requester holding it does; what a peer without it meets is tests/test_cluster_auth_attack.py.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_fixtures import StageConn, cluster_secret, owner_handshake, transfer_nodes, wait_slots_free

pytestmark = pytest.mark.cluster

UNIT = 64 << 10
KEYS = list(range(1, 5))
SECRET = cluster_secret()


@pytest.fixture(scope="module")
def served():
    from tutti_cluster.cluster.stage import StageServer

    owner, requester = transfer_nodes(UNIT)
    units = {k: os.urandom(UNIT) for k in KEYS}
    checked: list[int] = []
    srv = StageServer(owner, units.get, check=checked.append, max_window=2, idle_timeout_s=5, secret=SECRET).start()
    yield owner, requester, units, srv, checked
    srv.stop()
    owner.close()
    requester.close()


def assert_error_shape(reply: dict) -> None:
    assert set(reply) == {"error"} and isinstance(reply["error"], str) and reply["error"], reply


def assert_still_serving(srv, owner, units) -> None:
    """A whole stream works on a fresh connection, and every owner slot comes back afterwards."""
    from tutti_cluster.cluster.stage_stream import ping

    assert ping(srv.address, secret=SECRET)
    c = StageConn(srv.address)
    try:
        c.send(json.dumps({"op": "stage", "keys": KEYS[:2], "window": 2}).encode())
        got = [json.loads(c.f.readline()) for _ in range(2)]
        assert [m["key"] for m in got] == KEYS[:2] and all(m["len"] == UNIT for m in got)
        for m in got:
            c.send(json.dumps({"op": "done", "addr": m["addr"]}).encode())
        assert json.loads(c.f.readline()) == {"end": True}
    finally:
        c.close()
    assert wait_slots_free(owner, 4), "an owner slot was not returned"


BAD_LINES = [
    b"not json",
    b"[1, 2]",
    b"7",
    b'"stage"',
    b"null",
    b"{}",
    b'{"op": 7}',
    b'{"op": "nope"}',
    b'{"op": "stage"}',  # no keys
    b'{"op": "stage", "keys": "1234"}',
    b'{"op": "stage", "keys": [1e400]}',
    b'{"op": "stage", "keys": [1.5]}',
    b'{"op": "stage", "keys": [true]}',
    b'{"op": "stage", "keys": [-1]}',
    b'{"op": "stage", "keys": [18446744073709551616]}',
    b'{"op": "stage", "keys": [1], "window": 1e400}',
    b'{"op": "stage", "keys": [1], "window": 0}',
    b'{"op": "stage", "keys": [1], "window": "2"}',
    b'{"op": "stage", "keys": [1], "extra": 1}',
    b'{"op": "done"}',
    b'{"op": "done", "addr": "x"}',
    b'{"op": "done", "addr": -5}',
    b'{"op": "corrupt", "key": [1]}',
    b'{"op": "corrupt", "key": 1e400}',
    b'{"op": "ping", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b"[" * 100000,
    b"\xff\xfe garbage",
]


def test_every_malformed_line_gets_one_error_and_the_connection_stays(served):
    owner, _requester, units, srv, checked = served
    c = StageConn(srv.address)
    try:
        for line in BAD_LINES:
            assert_error_shape(c.ask(line))
        # The same connection still runs a stream.
        assert c.ask(b'{"op": "ping"}') == {"pong": True}
    finally:
        c.close()
    assert checked == []  # no malformed corrupt report reached the owner's check
    assert_still_serving(srv, owner, units)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.binary(max_size=200).filter(lambda b: b"\n" not in b and b.strip()),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                 lambda c: st.lists(c, max_size=4)
                 | st.dictionaries(st.sampled_from(["op", "keys", "window", "addr", "key", "x"]), c, max_size=4),
                 max_leaves=12).map(lambda v: json.dumps(v).encode()),
))
def test_random_lines_never_break_the_endpoint(served, line):
    owner, _requester, units, srv, _checked = served
    c = StageConn(srv.address)
    try:
        c.send(line)
        c.send(b'{"op": "ping"}')
        # Whatever the line was, the ping is answered on the same connection: a line that was a
        # valid request (a ping, a done for no slot, a stage) answers as the protocol says first.
        for _ in range(8):
            reply = json.loads(c.f.readline())
            if reply == {"pong": True}:
                break
            if "addr" in reply:  # a valid stage request: return the slot
                c.send(json.dumps({"op": "done", "addr": reply["addr"]}).encode())
        else:
            raise AssertionError("no pong")
    finally:
        c.close()


def test_the_endpoint_survives_random_lines(served):
    owner, _requester, units, srv, _checked = served
    assert_still_serving(srv, owner, units)


def test_a_line_over_the_limit_is_refused_and_the_connection_stays(served, monkeypatch):
    from tutti_cluster.cluster import stage_wire

    owner, _requester, units, srv, _checked = served
    monkeypatch.setattr(stage_wire, "MAX_LINE", 4096)
    c = StageConn(srv.address)
    try:
        assert_error_shape(c.ask(b'{"op": "stage", "keys": [' + b"1, " * 5000 + b"1]}"))
        assert c.ask(b'{"op": "ping"}') == {"pong": True}
    finally:
        c.close()


class _Chunks:
    """The socket side of the owner's line reader: recv hands out the given chunks in order, an
    exception among them is raised (a read timeout), then b"" (the end)."""

    def __init__(self, chunks: list) -> None:
        self.chunks = chunks

    def recv(self, _n: int) -> bytes:
        if not self.chunks:
            return b""
        c = self.chunks.pop(0)
        if isinstance(c, BaseException):
            raise c
        return c


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=8),
       tail=st.binary(max_size=20).map(lambda b: b.replace(b"\n", b"")),
       cuts=st.lists(st.integers(0, 50), max_size=12), limit=st.integers(4, 30))
def test_lines_are_split_like_a_bounded_readline_whatever_the_chunks(lines, tail, cuts, limit):
    """The owner's line reader (it outlives its socket's read timeouts, which a socket.makefile
    reader does not), the bytes in arbitrary chunks with read timeouts between them while the
    connection is not idle: the lines come out as they went in, one over the limit as b"" (too
    long), an unterminated last one as it is, then None. While idle, a timeout is raised."""
    from tutti_cluster.cluster import stage_wire

    data = b"".join(x + b"\n" for x in lines) + tail
    chunks: list = []
    pos = 0
    for n in cuts:  # a cut of 0 is a read timeout there
        chunks.append(data[pos:pos + n] if n else TimeoutError())
        pos += n
    chunks.append(data[pos:])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stage_wire, "MAX_LINE", limit)
        reader = stage_wire._Lines(_Chunks([c for c in chunks if c != b""]))
        got = []
        while (line := reader.next(lambda: False)) is not None:
            got.append(line)
    want = [x + b"\n" if len(x) + 1 <= limit else b"" for x in lines]
    if tail:
        want.append(tail if len(tail) <= limit else b"")
    assert got == want
    with pytest.raises(TimeoutError):
        stage_wire._Lines(_Chunks([b"{", TimeoutError()])).next(lambda: True)


class FakeOwner:
    """A stage endpoint that answers a scripted line to the requester's stage request: the faults
    an owner could send over the network, which a real server never does (hence the fake)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            assert owner_handshake(conn)
            f = conn.makefile("rwb")
            f.readline()
            f.write(self.answer + b"\n")
            f.flush()
            time.sleep(0.3)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(2)


@pytest.mark.parametrize("answer", [
    b"[1]", b"7", b"null", b'{"key": "x"}', b'{"key": 1, "addr": 4096, "len": -1}',
    b'{"key": 1, "addr": 4096, "len": 1e400}', b'{"key": 2, "addr": 4096, "len": 10}',
    b'{"key": 1, "addr": -1, "len": 10}', b'{"key": 1, "miss": 5}', b'{"error": ["x"]}', b"[" * 100000,
])
def test_a_requester_ends_its_stream_on_a_garbage_answer(served, answer):
    from tutti_cluster.cluster.stage_stream import StageStream

    owner, requester, _units, _srv, _checked = served
    fake = FakeOwner(answer)
    try:
        stream = StageStream(requester, fake.address, owner.segment, [1, 2], timeout_s=2, secret=SECRET)
        assert list(stream) == []
        assert stream.error, answer
    finally:
        fake.close()
    # The requester's slots all came back.
    held = [a for a in (requester.acquire(0) for _ in range(3)) if a is not None]
    for a in held:
        requester.release(a)
    assert len(held) == 3


class TricklingOwner(FakeOwner):
    """An owner that sends its answer one byte at a time, each well within the socket's timeout,
    so that no single read times out (a fake: a real server writes whole lines)."""

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            assert owner_handshake(conn)
            f = conn.makefile("rwb")
            f.readline()
            try:
                for b in b'{"key": 1, "addr": 4096, "len": 10' + b" " * 1000:
                    f.write(bytes([b]))
                    f.flush()
                    time.sleep(0.1)
            except OSError:
                pass  # the requester cut the connection


def test_a_trickling_owner_is_cut_off_after_the_timeout(served):
    from tutti_cluster.cluster.stage_stream import StageStream

    owner, requester, _units, _srv, _checked = served
    fake = TricklingOwner(b"")
    try:
        t0 = time.monotonic()
        stream = StageStream(requester, fake.address, owner.segment, [1], timeout_s=1.0, secret=SECRET)
        assert list(stream) == []
        assert "within 1.0 s" in (stream.error or ""), stream.error
        assert time.monotonic() - t0 < 10  # the socket's own timeout (1 s per read) never fired
    finally:
        fake.close()


class AnnounceThenWaitOwner(FakeOwner):
    """Announces one unit of a real slot and then waits for its `done`, silent, as an owner whose
    window is full does (a real one cuts after idle_timeout_s, 30 s by default; a partitioned one
    never reaches us at all)."""

    def __init__(self, addr: int, hold_s: float) -> None:
        self.addr, self.hold_s = addr, hold_s
        super().__init__(b"")

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            assert owner_handshake(conn)
            f = conn.makefile("rwb")
            f.readline()
            f.write(json.dumps({"key": 1, "addr": self.addr, "len": UNIT}).encode() + b"\n")
            f.flush()
            time.sleep(self.hold_s)


def test_a_failed_pull_ends_the_stream_while_the_owner_waits_for_our_done(served, monkeypatch):
    from tutti_cluster.cluster.stage_stream import StageStream
    from tutti_cluster.errors import TuttiError

    owner, requester, _units, _srv, _checked = served
    real_wait = requester.wait

    def failing_wait(pull):  # a transfer failure (the owner's host gone, a network fault)
        real_wait(pull)
        raise TuttiError("transfer failed (a fake)")

    monkeypatch.setattr(requester, "wait", failing_wait)
    addr = owner.acquire(1)
    fake = AnnounceThenWaitOwner(addr, hold_s=20)
    out: dict = {}
    stream = StageStream(requester, fake.address, owner.segment, [1, 2], window=1, timeout_s=1.0, secret=SECRET)
    t = threading.Thread(target=lambda: out.update(got=list(stream)), daemon=True)
    try:
        t0 = time.monotonic()
        t.start()
        t.join(8)
        assert not t.is_alive(), f"stream still running after {time.monotonic() - t0:.1f} s: {stream.error}"
        assert out["got"] == [] and "transfer failed" in (stream.error or "")
    finally:
        t.join(25)
        fake.close()
        owner.release(addr)

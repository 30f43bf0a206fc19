"""Transfer path with raw buffers: stage endpoint + Mooncake Transfer Engine (TCP, P2P handshake).

The owner's unit source here is a dict of random byte strings (the transfer path does not look
inside units); the store-backed path is covered by test_cluster.py and test_daemon.py.
"""

from __future__ import annotations

import os
import time

import pytest

from cluster_fixtures import (StageConn, cluster_secret, engines, free_port, require_mooncake,  # noqa: F401 (fixture)
                              wait_slots_free)
from tutti_cluster.errors import ConfigError

pytestmark = pytest.mark.cluster

UNIT = 1 << 20
SECRET = cluster_secret()


@pytest.fixture
def served(engines):
    from tutti_cluster.cluster.stage import StageServer

    owner, requester = engines
    units = {k: os.urandom(UNIT - 4096 * (k % 3)) for k in range(1, 9)}
    srv = StageServer(owner, units.get, max_window=3, idle_timeout_s=5, secret=SECRET).start()
    yield owner, requester, units, srv
    srv.stop()


def test_stream_is_byte_exact_and_in_order(served):
    from tutti_cluster.cluster.stage_stream import StageStream

    owner, requester, units, srv = served
    keys = list(range(1, 9))
    for depth in (2, 3):  # one pull in flight, or two
        for window in (1, 2, 3, 8):
            stream = StageStream(requester, srv.address, owner.segment, keys, window=window, depth=depth, secret=SECRET)
            got = [(k, bytes(v)) for k, v in stream]
            assert [k for k, _ in got] == keys and stream.error is None
            assert all(v == units[k] for k, v in got)
    assert srv.stats.units_staged == srv.stats.units_copied == 8 * len(keys)  # a bytes source: one copy each
    assert wait_slots_free(owner, 4) and wait_slots_free(requester, 3)


def test_held_slots_stay_the_callers_until_done(served):
    """hold=True (an asynchronous consumer): each view stays valid until its done(), even while
    later units arrive, and every slot comes back."""
    from tutti_cluster.cluster.stage_stream import StageStream

    owner, requester, units, srv = served
    keys = list(range(1, 9))
    stream = StageStream(requester, srv.address, owner.segment, keys, window=2, depth=3, hold=True, secret=SECRET)
    held: list = []
    got = []
    for key, view, done in stream:
        held.append((key, view, done))
        if len(held) == 2:  # depth - 1 held, as the client keeps them
            k, v, d = held.pop(0)
            got.append(k)
            assert bytes(v) == units[k]  # not overwritten by the pulls after it
            d()
            d()  # a second call does nothing
    for k, v, d in held:
        got.append(k)
        assert bytes(v) == units[k]
        d()
    assert got == keys and stream.error is None
    assert wait_slots_free(owner, 4) and wait_slots_free(requester, 3)


def test_an_owner_waiting_for_our_done_is_not_silent(served, monkeypatch):
    """The owner announces `window` units and then waits for their `done`: while our pulls are
    slower than our line timeout, its silence is ours and must not cut it off, also where we ask
    for a window above the owner's (3 here), which it then answers with its own. Slow pulls are a
    slow network, which the loopback does not make: each wait is stretched by a sleep (a fake)."""
    from tutti_cluster.cluster.stage_stream import StageStream

    owner, requester, units, srv = served
    real_wait = requester.wait

    def slow_wait(pull):
        time.sleep(1.5)
        return real_wait(pull)

    monkeypatch.setattr(requester, "wait", slow_wait)
    for keys, window, depth in (([1, 2, 3], 1, 2), ([1, 2, 3, 4, 5], 4, 4)):
        stream = StageStream(requester, srv.address, owner.segment, keys, window=window, depth=depth, timeout_s=1.0, secret=SECRET)
        got = [(k, bytes(v)) for k, v in stream]
        assert stream.error is None, (window, stream.error)
        assert [k for k, _ in got] == keys and all(v == units[k] for k, v in got)
        assert wait_slots_free(owner, 4) and wait_slots_free(requester, 3)


def test_stream_stops_at_the_first_miss(served):
    from tutti_cluster.cluster.stage_stream import StageStream

    owner, requester, units, srv = served
    s = StageStream(requester, srv.address, owner.segment, [1, 2, 99, 3], secret=SECRET)
    assert [k for k, _ in s] == [1, 2]
    assert s.miss == "not found" and s.error is None


def test_unit_larger_than_a_slot_is_a_miss(engines):
    from tutti_cluster.cluster.stage import StageServer
    from tutti_cluster.cluster.stage_stream import StageStream

    owner, requester = engines
    srv = StageServer(owner, {1: b"x" * 100, 2: b"y" * (UNIT + 1)}.get, secret=SECRET).start()
    try:
        s = StageStream(requester, srv.address, owner.segment, [1, 2], secret=SECRET)
        assert [bytes(v) for _, v in s] == [b"x" * 100]
        assert s.miss and s.miss.startswith("staging")
    finally:
        srv.stop()


def test_unreachable_owner_ends_the_stream_without_raising(engines):
    from tutti_cluster.cluster.stage_stream import StageStream, ping

    owner, requester = engines
    addr = f"127.0.0.1:{free_port()}"
    s = StageStream(requester, addr, owner.segment, [1, 2], timeout_s=1, secret=SECRET)
    assert list(s) == [] and s.error and "connect" in s.error
    assert not ping(addr, 0.5)


def test_wrong_segment_is_a_transfer_failure_not_an_exception(served):
    from tutti_cluster.cluster.stage_stream import StageStream

    owner, requester, units, srv = served
    s = StageStream(requester, srv.address, f"127.0.0.1:{free_port()}", [1, 2], timeout_s=2, secret=SECRET)
    assert list(s) == [] and s.error


def test_dropped_requester_returns_its_slots(served):
    owner, requester, units, srv = served
    c = StageConn(srv.address)
    c.send({"op": "stage", "keys": [1, 2, 3], "window": 3})
    announced = [c.recv() for _ in range(3)]
    assert all("addr" in m for m in announced)
    c.close()
    # The server notices the close and reclaims the three slots it had lent.
    import time

    deadline = time.monotonic() + 5
    while srv.stats.reclaimed_slots < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.stats.reclaimed_slots == 3
    from tutti_cluster.cluster.stage_stream import ping

    assert ping(srv.address, secret=SECRET)


def test_bad_settings_are_config_errors():
    require_mooncake()
    from tutti_cluster.cluster.transfer import TransferNode

    with pytest.raises(ConfigError):
        TransferNode(protocol="udp")
    with pytest.raises(ConfigError):
        TransferNode(arena_bytes=0)


def test_retired_slot_is_never_lent_again():
    """A pull that timed out may still land later: its local slot leaves the pool for good."""
    require_mooncake()
    from tutti_cluster.cluster.transfer import TransferNode
    from tutti_cluster.errors import TuttiError

    requester = TransferNode(arena_bytes=2 * UNIT + 8192, slot_bytes=UNIT - 100)  # stride rounds up to 4 KiB
    a = requester.acquire(0)
    b = requester.acquire(0)
    assert a is not None and b is not None and requester.acquire(0) is None
    requester.retire(a)
    requester.release(a)  # the stream's cleanup returns it: ignored
    requester.release(b)
    assert requester.acquire(0) == b and requester.acquire(0) is None
    requester.release(b)
    with pytest.raises(TuttiError):
        requester.configure(UNIT // 2)  # the retired slot's memory cannot be cut up again
    assert requester.base % 4096 == 0 and (b - requester.base) % 4096 == 0  # O_DIRECT alignment
    requester.close()

"""Stage stream, the requester's side: :class:`StageStream` pulls units an owner stages, and
:func:`ping`. The protocol is described in :mod:`tutti_cluster.cluster.stage_wire`."""

from __future__ import annotations

import functools
import os
import queue
import socket
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from pydantic import ValidationError

from tutti_cluster.cluster.auth import AuthError, ClusterSecret
from tutti_cluster.cluster.stage_wire import (
    _ANSWER, _U64, CorruptOp, DoneOp, End, Failure, Hello, Miss, PingOp, StageOp, _connect, _handshake_line,
    _host_port, _Line, _Lines, _why)
from tutti_cluster.cluster.transfer import Pull, TransferNode
from tutti_cluster.errors import TuttiError

# The completer may be waiting out a pull's deadline (Mooncake's transfer timeout plus 1 s per GiB).
_TRANSFER_JOIN_S = 10.0


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, run at its first call only."""
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            fn()

    return call


def default_depth() -> int:
    """Local slots of a stage stream (see :class:`StageStream`)."""
    return 3 if (os.cpu_count() or 1) > 4 else 2


class StageStream:
    """Requester side of one stage stream. Iterate to get ``(key, view)`` pairs in key order.

    Each view is a slot of the requester's own arena holding the unit's bytes; it is valid until the
    next iteration step (the slot is then reused). With ``hold`` the items are ``(key, view, done)``
    instead: the slot stays the caller's until it calls ``done()`` (for an asynchronous consumer,
    such as a scatter ordered on a GPU stream), also past the stream's end; the caller keeps at most
    ``depth - 1`` slots, so that one is left to pull into. The iteration ends early at the owner's first
    miss or at any fault (connection refused or dropped, transfer failure, timeout): the caller
    treats the rest as misses. Faults are counted in ``error`` and never raised.

    Up to ``depth`` local slots are used: while the caller works on one unit, the others are being
    pulled, so ``depth - 1`` pulls are in flight at once. The default is two pulls in flight
    above four cores (measured on 16), and one below, where a second pull competes for the cores
    with the Transfer Engine's threads and the scatter (no clear gain measured on 2).
    """

    def __init__(self, transfer: TransferNode, stage_addr: str, segment: str, keys: Sequence[int],
                 window: int = 2, timeout_s: float = 5.0, depth: int | None = None, hold: bool = False, *,
                 secret: ClusterSecret) -> None:
        """``secret``: the cluster credential, proven to the owner (and the owner's proof checked)
        before the request is sent; an owner that fails it ends the stream with ``error`` set."""
        if not isinstance(secret, ClusterSecret):
            raise TypeError("StageStream needs the cluster credential (a ClusterSecret)")
        self.secret = secret
        self.transfer = transfer
        self.hold = hold
        self.depth = max(2, depth or default_depth())
        self.stage_addr = stage_addr
        self.segment = segment
        self.keys = [int(k) & 0xFFFFFFFFFFFFFFFF for k in keys]
        self.window = window
        self.timeout_s = timeout_s
        self.error: str | None = None
        self.miss: str | None = None
        self.bytes = 0
        self.pull_s = 0.0  # summed submit-to-completion time of the pulls (they overlap)
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()  # the completer's `done` and the consumer's `corrupt`

    def _send(self, sock: socket.socket, msg: _Line) -> None:
        with self._send_lock:
            sock.sendall(msg.line())

    def report_corrupt(self, key: int) -> None:
        """Tell the owner that ``key`` failed our checksums; best effort. On the stream's connection
        while it is open, else on a connection of its own (a unit judged after the stream ended)."""
        msg = CorruptOp(key=int(key) & _U64)
        try:
            if self._sock is not None:
                self._send(self._sock, msg)
                return
        except OSError:
            pass
        try:
            s, _ = _connect(self.stage_addr, self.secret, self.timeout_s)
            with s:
                s.sendall(msg.line())
        except (OSError, ValueError, AuthError):
            pass

    def __iter__(self) -> Iterator[Any]:
        # Two threads: the puller reads the owner's announcements and submits a pull of each unit
        # into a free local slot; the completer waits for the pulls in order, returns each owner
        # slot (`done`) and hands the unit over. The Transfer Engine and the store's scatter both
        # release the GIL, so pulls, waits and the caller's scatter overlap.
        try:
            sock, rest = _connect(self.stage_addr, self.secret, self.timeout_s)
        except AuthError as exc:
            self.error = f"authentication with {self.stage_addr!r}: {exc}"
            return
        except (OSError, ValueError) as exc:
            self.error = f"connect {self.stage_addr!r}: {exc}"
            return
        self._sock = sock
        submitted: queue.Queue[tuple[int, int, int, Pull] | None] = queue.Queue()
        ready: queue.Queue[tuple[int, int, int] | None] = queue.Queue()
        free: queue.Queue[int] = queue.Queue()
        held: list[int] = []
        stop = threading.Event()
        in_flight = threading.Semaphore(self.depth - 1)  # pulls at once; the last slot is the caller's
        # The line timeout: the owner must answer within timeout_s of our asking for a line, counted
        # only while we owe it nothing. Units announced and not yet answered with `done` are owed;
        # with a window's worth of them (the owner's window, which may be smaller than ours) the
        # owner waits on our pulls and is silent by rule.
        owed = 0
        line_since: float | None = None  # when the puller began waiting for the current line
        quiet_since = time.monotonic()  # when we last came to owe the owner nothing
        owed_cv = threading.Condition()

        def local_slot() -> int | None:
            if len(held) < self.depth:
                addr = self.transfer.acquire(0 if held else self.timeout_s)
                if addr is not None:
                    held.append(addr)
                    return addr
                if not held:
                    return None
            deadline = time.monotonic() + self.timeout_s
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    return free.get(timeout=0.05)
                except queue.Empty:
                    continue
            return None

        def cut() -> None:
            if self.error is None:
                self.error = f"no whole answer from the owner within {self.timeout_s} s"
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def watchdog() -> None:
            # Bounds the whole line, which an owner sending a byte now and then would otherwise
            # stretch without end; the socket's read timeouts alone do not end the stream.
            with owed_cv:
                while not stop.is_set():
                    if line_since is None or owed:
                        owed_cv.wait()
                        continue
                    left = max(line_since, quiet_since) + self.timeout_s - time.monotonic()
                    if left <= 0:
                        cut()
                        return
                    owed_cv.wait(left)

        def puller() -> None:
            nonlocal owed, line_since
            try:
                sock.settimeout(self.timeout_s)  # sends, and reads once stopped; the watchdog bounds lines
                lines = _Lines(sock)
                lines.buf += rest
                self._send(sock, StageOp(keys=self.keys, window=max(1, self.window)))
                expected = iter(self.keys)
                while not stop.is_set():
                    with owed_cv:
                        line_since = time.monotonic()
                        owed_cv.notify_all()
                    line = lines.next(stop.is_set)  # read timeouts end only a stopped stream
                    with owed_cv:
                        line_since = None
                    if line is None:
                        self.error = self.error or "owner closed the stream"
                        return
                    try:
                        msg = _ANSWER.validate_json(line)
                    except ValidationError as exc:
                        why = _why(exc) if line else "line too long"
                        self.error = self.error or f"bad answer from the owner: {why}"
                        return
                    if isinstance(msg, End):
                        return
                    if isinstance(msg, Failure):
                        self.error = msg.error
                        return
                    key = msg.key
                    if key != next(expected, None):
                        self.error = "owner answered out of order"
                        return
                    if isinstance(msg, Miss):
                        self.miss = msg.miss
                        return
                    n = msg.len
                    if self.transfer.slot_bytes == 0 and not held:
                        self.transfer.configure(n)
                    if n > self.transfer.slot_bytes:
                        self.error = f"unit of {n} bytes exceeds the {self.transfer.slot_bytes}-byte local slots"
                        return
                    local = local_slot()
                    if local is None:
                        if not stop.is_set():
                            self.error = "no free local slot"
                        return
                    while not in_flight.acquire(timeout=0.05):
                        if stop.is_set():
                            free.put(local)
                            return
                    try:
                        pull = self.transfer.start_read(self.segment, local, msg.addr, n)
                    except TuttiError:
                        in_flight.release()
                        free.put(local)
                        raise
                    with owed_cv:
                        owed += 1
                    submitted.put((key, local, msg.addr, pull))
            except (OSError, TuttiError) as exc:
                if not stop.is_set():
                    self.error = self.error or f"{type(exc).__name__}: {exc}"
            finally:
                submitted.put(None)

        def completer() -> None:
            nonlocal owed, quiet_since
            failed = False
            while (item := submitted.get()) is not None:
                key, local, remote, pull = item
                try:
                    # A submitted pull is always waited for: its slot is not reused before.
                    try:
                        self.transfer.wait(pull)
                    finally:
                        in_flight.release()
                    if failed or stop.is_set():
                        continue
                    self.pull_s += pull.seconds
                    self._send(sock, DoneOp(addr=remote))
                    with owed_cv:
                        owed -= 1
                        if not owed:
                            quiet_since = time.monotonic()
                            owed_cv.notify_all()
                except (OSError, TuttiError) as exc:
                    if not failed and not stop.is_set():
                        self.error = self.error or f"{type(exc).__name__}: {exc}"  # a cut() said why first
                    failed = True
                    with owed_cv:
                        stop.set()
                        owed_cv.notify_all()
                    continue
                self.bytes += pull.length
                ready.put((key, local, pull.length))
            ready.put(None)

        threads = [threading.Thread(target=puller, name="tutti-stage-pull", daemon=True),
                   threading.Thread(target=completer, name="tutti-stage-wait", daemon=True),
                   threading.Thread(target=watchdog, name="tutti-stage-watch", daemon=True)]
        for t in threads:
            t.start()
        # Hold mode: slots lent to the caller are its own until its done(), even past the stream's
        # end (which comes inside the caller's next()): then done() returns them to the arena.
        lent: set[int] = set()
        lent_lock = threading.Lock()
        ended = False

        def give_back(local: int) -> None:
            with lent_lock:
                lent.discard(local)
                if not ended:
                    free.put(local)
                    return
            self.transfer.release(local)

        try:
            while True:
                item = ready.get()
                if item is None:
                    break
                key, local, n = item
                if self.hold:
                    with lent_lock:
                        lent.add(local)
                    yield key, self.transfer.view(local, n), _once(functools.partial(give_back, local))
                else:
                    yield key, self.transfer.view(local, n)
                    free.put(local)
        finally:
            with owed_cv:
                stop.set()
                owed_cv.notify_all()
            self._sock = None
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            for t in threads:
                t.join(self.timeout_s + _TRANSFER_JOIN_S)
            try:
                sock.close()
            except OSError:
                pass
            with lent_lock:
                ended = True
                mine = [a for a in held if a not in lent]
            for addr in mine:
                self.transfer.release(addr)


def ping(stage_addr: str, timeout_s: float = 2.0, *, secret: ClusterSecret | None = None) -> bool:
    """True when a stage endpoint answers: with ``secret``, an authenticated ping (both sides
    prove the credential, then a ``ping`` is answered); without, its handshake's first line."""
    deadline = time.monotonic() + timeout_s
    try:
        if secret is None:
            with socket.create_connection(_host_port(stage_addr), timeout=timeout_s) as s:
                Hello.model_validate_json(_handshake_line(s, bytearray(), deadline))
                return True
        s, buf = _connect(stage_addr, secret, timeout_s)
        with s:
            s.sendall(PingOp().line())
            return b"pong" in _handshake_line(s, buf, deadline)
    except (OSError, ValueError, AuthError):  # ValidationError is a ValueError
        return False

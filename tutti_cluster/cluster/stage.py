"""Stage endpoint, the owner's side: :class:`StageServer` stages units for requesters that prove the
cluster credential. The protocol is described in :mod:`tutti_cluster.cluster.stage_wire`."""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import ValidationError

from tutti_cluster.cluster.auth import OWNER, REQUESTER, AuthError, ClusterSecret, new_nonce
from tutti_cluster.cluster.stage_wire import (
    _REQUEST, MAX_LINE, Announce, AuthOp, CorruptOp, DoneOp, End, Failure, Hello, Miss, Pong, StageOp, Welcome, _Line,
    _Lines, _handshake_line, _why)
from tutti_cluster.cluster.transfer import TransferNode
from tutti_cluster.node.protocol import SHUTDOWN_POLL_S  # the node's accept loops: the daemon's and this one
from tutti_cluster.errors import TuttiError

log = logging.getLogger(__name__)

# read_unit(key) -> the unit's bytes (read_unit format), or None when the node does not hold it.
UnitReader = Callable[[int], "bytes | None"]
# read_into(key, view) -> bytes written into `view` (a whole registered slot), or None when absent:
# the node daemon's reader (store.read_unit_into), which reads in place, with no copy.
UnitReaderInto = Callable[[int, memoryview], "int | None"]
# check(key): called for a unit a requester reported corrupt; verifies the local copy, drops it if bad.
UnitCheck = Callable[[int], None]

# An owner whose slots are all lent waits this long for one, then answers 'busy'. This wait plus
# the unit's read must stay below the requester's line timeout (StageStream's and ClusterClient's
# timeout_s: 5 s by default, 3 s in the cluster tests): a requester that hears nothing within it
# cuts the owner off as silent (an error; ClusterClient then forgets the owner's node record) while
# the owner is still waiting on its behalf.
SLOT_TIMEOUT_S = 2.0
AUTH_TIMEOUT_S = 3.0  # an unauthenticated connection's whole handshake, on the owner's side
MAX_HANDSHAKES = 64  # connections in their handshake at once; more are closed at once
REFUSAL_LOG_S = 10.0  # refused handshakes: at most one warning line per this many seconds


@dataclass
class StageStats:
    handshakes: int = 0  # connections authenticated
    auth_failures: int = 0  # connections refused before a request was read (no or wrong proof, too slow, too many)
    streams: int = 0
    units_staged: int = 0
    bytes_staged: int = 0
    read_s: float = 0.0  # time spent reading units into slots (summed over reader threads)
    units_copied: int = 0  # staged through a bytes copy (sources without read_into), not in place
    misses: int = 0
    corrupt_reports: int = 0  # units requesters found corrupt (the owner then checks its copy)
    reclaimed_slots: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


class StageServer:
    """Serves stage requests on ``host:port`` (port 0 picks one) from a background thread, to
    requesters that prove ``secret`` (the cluster credential) on each connection. It listens on
    ``host`` alone: the address it advertises, never every interface."""

    def __init__(self, transfer: TransferNode, read_unit: UnitReader | None, host: str = "127.0.0.1", port: int = 0,
                 max_window: int = 4, slot_timeout_s: float = SLOT_TIMEOUT_S, idle_timeout_s: float = 30.0,
                 read_into: UnitReaderInto | None = None, readers: int | None = None,
                 check: UnitCheck | None = None, *, secret: ClusterSecret, auth_timeout_s: float = AUTH_TIMEOUT_S,
                 max_handshakes: int = MAX_HANDSHAKES) -> None:
        if not isinstance(secret, ClusterSecret):
            raise TypeError("StageServer needs the cluster credential (a ClusterSecret)")
        self.secret = secret
        self.auth_timeout_s = auth_timeout_s
        self._handshaking = threading.BoundedSemaphore(max(1, max_handshakes))
        self._refusals_lock = threading.Lock()
        self._refusals_unlogged = 0
        self._refusal_logged_at: float | None = None
        self.transfer = transfer
        # Units read at once per stream. A read is an O_DIRECT read straight into a registered slot
        # (the requester verifies the checksums), so it mostly waits on the device: two in flight
        # keep the SSD busy (measured here for 32 MiB units: 0.73-0.97 GiB/s with one reader,
        # 0.85-1.1 with two), and more than one per two cores only adds contention with the
        # Transfer Engine's TCP threads.
        self.readers = max(1, readers or max(2, min(4, (os.cpu_count() or 2) // 2)))
        self.read_unit = read_unit
        self.read_into = read_into
        self.check = check
        self.max_window = max(1, max_window)
        self.slot_timeout_s = slot_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.stats = StageStats()
        self._slot_lock = threading.Lock()
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                if not outer._handshaking.acquire(blocking=False):
                    outer._refused(self.client_address, "too many connections in their handshake")
                    return
                try:
                    rest = outer._authenticate(self.connection, self.wfile, self.client_address)
                finally:
                    outer._handshaking.release()
                if rest is not None:
                    outer._serve_connection(self.connection, self.wfile, rest)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(SHUTDOWN_POLL_S,), name="tutti-stage",
                                        daemon=True)

    def start(self) -> "StageServer":
        self._thread.start()
        log.info("stage endpoint on %s", self.address)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- authentication ---------------------------------------------------------------------------
    def _authenticate(self, conn: socket.socket, wfile, peer: Any) -> bytearray | None:  # type: ignore[no-untyped-def]
        """The owner's side of the handshake: the bytes read past it once the requester proved the
        credential (and we proved it back), else None (refused, counted, the connection to close)."""
        deadline = time.monotonic() + self.auth_timeout_s
        nonce = new_nonce()
        buf = bytearray()
        try:
            conn.settimeout(self.auth_timeout_s)
            wfile.write(Hello(nonce=nonce.hex()).line())
            line = _handshake_line(conn, buf, deadline)
            try:
                msg = AuthOp.model_validate_json(line)
            except ValidationError as exc:
                why = f"no valid auth line first ({_why(exc)})"
            else:
                theirs = bytes.fromhex(msg.nonce)
                index = self.secret.verify_proof(bytes.fromhex(msg.proof), REQUESTER, nonce, theirs)
                if index is not None:
                    wfile.write(Welcome(proof=self.secret.prove(OWNER, nonce, theirs, index).hex()).line())
                    self.stats.handshakes += 1
                    return buf
                why = "wrong proof (another credential, or a replayed handshake)"
        except TimeoutError:
            why = f"no handshake within {self.auth_timeout_s:g} s"
        except (OSError, AuthError) as exc:
            why = str(exc)
        self._refused(peer, why)
        try:
            wfile.write(Failure(error="authentication failed").line())
        except OSError:
            pass
        return None

    def _refused(self, peer: Any, why: str) -> None:
        """Count a refused connection; warn at most once per REFUSAL_LOG_S (the count says how many)."""
        now = time.monotonic()
        with self._refusals_lock:
            self.stats.auth_failures += 1
            self._refusals_unlogged += 1
            if self._refusal_logged_at is not None and now - self._refusal_logged_at < REFUSAL_LOG_S:
                return
            n, self._refusals_unlogged, self._refusal_logged_at = self._refusals_unlogged, 0, now
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)
        log.warning("stage endpoint %s refused %d unauthenticated connection(s)%s; the last from %s: %s",
                    self.address, n, f" in {REFUSAL_LOG_S:g} s" if n > 1 else "", where, why)

    # -- one connection ---------------------------------------------------------------------------
    def _serve_connection(self, conn: socket.socket, wfile, rest: bytearray | None = None) -> None:  # type: ignore[no-untyped-def]
        outstanding: set[int] = set()
        credit = threading.Semaphore(0)
        wlock = threading.Lock()
        stream: threading.Thread | None = None
        closed = threading.Event()
        lent = threading.Lock()  # `outstanding` and `closed`: a slot is announced only while open

        sent_at = time.monotonic()

        def send(msg: _Line) -> None:
            nonlocal sent_at
            with wlock:
                wfile.write(msg.line())
                wfile.flush()
                sent_at = time.monotonic()

        def idle() -> bool:
            # The connection is idle when the requester owes the next line (its request, a `done`)
            # and has not sent it within idle_timeout_s of our last answer; not while its stream
            # is still reading a unit or waiting for a free slot (up to slot_timeout_s).
            if time.monotonic() - sent_at < self.idle_timeout_s:
                return False
            with lent:
                return stream is None or not stream.is_alive() or bool(outstanding)

        def run_stream(keys: list[int], window: int) -> None:
            # Up to `window` units are prepared at once (SSD read + copy into a slot, in worker
            # threads: the store's read releases the GIL) and announced strictly in key order. A
            # credit comes back with each `done`, so at most `window` slots are lent at a time.
            self.stats.streams += 1
            for _ in range(window):
                credit.release()
            pending: deque[tuple[int, Future]] = deque()
            todo = iter(keys)
            exhausted = False
            pool = ThreadPoolExecutor(max_workers=min(window, self.readers), thread_name_prefix="tutti-stage-read")

            def top_up(block: bool) -> None:
                nonlocal exhausted
                while not exhausted and not closed.is_set():
                    if not credit.acquire(timeout=self.idle_timeout_s if block and not pending else 0):
                        return
                    k = next(todo, None)
                    if k is None:
                        exhausted = True
                        credit.release()
                        return
                    pending.append((k, pool.submit(self._prepare, k)))

            try:
                while True:
                    top_up(block=True)
                    if not pending or closed.is_set():
                        break
                    k, fut = pending.popleft()
                    res = fut.result()
                    if isinstance(res, str):
                        self.stats.misses += 1
                        send(Miss(key=k, miss=res))
                        break
                    addr, n = res
                    with lent:
                        if closed.is_set():  # the requester left while this unit was read
                            self.transfer.release(addr)
                            break
                        outstanding.add(addr)
                    send(Announce(key=k, addr=addr, len=n))
                if not closed.is_set():
                    send(End())
            except OSError:
                pass  # requester went away; slots are reclaimed below
            finally:
                # Units prepared past a miss or a dropped connection were never announced.
                for _k, fut in pending:
                    res = fut.result()
                    if not isinstance(res, str):
                        self.transfer.release(res[0])
                pool.shutdown(wait=True)

        conn.settimeout(self.idle_timeout_s)
        lines = _Lines(conn)
        lines.buf += rest or b""
        try:
            while (line := lines.next(idle)) is not None:
                if not line:
                    send(Failure(error=f"request line longer than {MAX_LINE} bytes"))
                    continue
                try:
                    msg = _REQUEST.validate_json(line)
                except ValidationError as exc:
                    send(Failure(error=f"bad request: {_why(exc)}"))
                    continue
                if isinstance(msg, DoneOp):
                    with lent:
                        known = msg.addr in outstanding
                        outstanding.discard(msg.addr)
                    if known:
                        self.transfer.release(msg.addr)
                        credit.release()
                elif isinstance(msg, StageOp):
                    if stream is not None:  # its credits are this connection's: one stream each
                        send(Failure(error="one stream per connection: this one has had its stream"))
                        continue
                    window = min(msg.window, self.max_window)
                    stream = threading.Thread(target=run_stream, args=(msg.keys, window), daemon=True)
                    stream.start()
                elif isinstance(msg, CorruptOp):
                    self.stats.corrupt_reports += 1
                    if self.check is not None:
                        try:
                            self.check(msg.key)
                        except Exception:  # noqa: BLE001 - the owner's check must not end the connection
                            log.warning("checking unit %x after a corrupt report failed", msg.key, exc_info=True)
                else:
                    send(Pong())
        except OSError as exc:
            log.debug("stage connection ended: %s", exc)
        finally:
            with lent:
                closed.set()
            credit.release()  # wake a stream blocked on credit so it sees `closed`
            if stream is not None:
                stream.join(self.slot_timeout_s + 1)
            with lent:  # a stream still reading (a stalled disk) releases what it reads from now on
                left = list(outstanding)
                outstanding.clear()
            for addr in left:
                self.transfer.release(addr)
                self.stats.reclaimed_slots += 1

    def _prepare(self, key: int) -> tuple[int, int] | str:
        """Read ``key`` into a free slot: ``(addr, length)``, or the reason it is a miss."""
        if self.read_into is not None:
            return self._prepare_into(key)
        return self._prepare_copy(key)

    def _prepare_into(self, key: int) -> tuple[int, int] | str:
        """The reader writes the unit straight into a registered slot: no copy on this side."""
        assert self.read_into is not None
        if not self.transfer.slot_bytes:
            return "staging: slot size unknown (no unit geometry yet)"
        addr = self.transfer.acquire(self.slot_timeout_s)
        if addr is None:
            return "busy"
        t0 = time.perf_counter()
        try:
            got = self.read_into(key, self.transfer.view(addr, self.transfer.slot_bytes))
        except TuttiError as exc:
            got, reason = None, f"unreadable: {exc}"
        else:
            reason = "not found"
        if got is None:
            self.transfer.release(addr)
            return reason
        self.stats.units_staged += 1
        self.stats.bytes_staged += got
        self.stats.read_s += time.perf_counter() - t0
        return addr, got

    def _prepare_copy(self, key: int) -> tuple[int, int] | str:
        """Sources that hand out bytes (no ``read_into``): one copy into the slot."""
        if self.read_unit is None:
            return "not found"
        t0 = time.perf_counter()
        try:
            data = self.read_unit(key)
        except TuttiError as exc:
            return f"unreadable: {exc}"
        if data is None:
            return "not found"
        n = len(data)
        with self._slot_lock:
            # The first unit sizes the slots (all units of one model have one size); the size never
            # changes under a running stream.
            if self.transfer.slot_bytes == 0:
                try:
                    self.transfer.configure(n)
                except TuttiError as exc:
                    return f"staging: {exc}"
            if n > self.transfer.slot_bytes:
                return f"staging: unit of {n} bytes exceeds the {self.transfer.slot_bytes}-byte slots"
        addr = self.transfer.acquire(self.slot_timeout_s)
        if addr is None:
            return "busy"
        self.transfer.put(addr, data)
        self.stats.units_copied += 1
        self.stats.units_staged += 1
        self.stats.bytes_staged += n
        self.stats.read_s += time.perf_counter() - t0
        return addr, n

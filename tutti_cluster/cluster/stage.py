"""Stage endpoint: a tiny TCP JSON-lines protocol that asks an owner node to stage cache units.

The bytes never travel over this socket: the owner reads each unit from its SSD straight into a
slot of its registered arena (``read_into``; the node daemon's reader is ``store.read_unit_into``,
O_DIRECT in place) and answers with the slot address; the requester pulls the bytes with the Transfer Engine
(one-sided read) and answers ``done`` so the owner can reuse the slot. With a window of W slots the
owner reads unit i+1 from its SSD while unit i is on the wire.

Protocol (one stream per connection, requests and answers are single JSON lines). Each connection
opens with a mutual challenge-response over the cluster credential (:mod:`.auth`), before any request
is read::

    <- {"hello": "tutti-stage/1", "nonce": Ns}     the owner's fresh 32-byte nonce (hex)
    -> {"op": "auth", "nonce": Nr, "proof": Pr}    Pr = HMAC(secret, stage|requester|Ns|Nr)
    <- {"proof": Po}                               Po = HMAC(secret, stage|owner|Ns|Nr): the requester
                                                   checks it before it sends a request
    <- {"error": "authentication failed"}          instead, to a wrong or missing proof; the owner
                                                   closes the connection and counts it (``auth_failures``)

The handshake must be over within ``auth_timeout_s`` (3 s), however the peer paces its bytes, and
at most ``max_handshakes`` (64) connections are in it at once (others are closed at once), so
connections that never authenticate cost the owner a bounded number of threads for a bounded time.
Then, on the authenticated connection:

    -> {"op": "stage", "keys": [k0, k1, ...], "window": W}
    <- {"key": k0, "addr": A, "len": N}            one per unit, in key order
    -> {"op": "done", "addr": A}                   requester has pulled A
    -> {"op": "corrupt", "key": k}                 k failed the requester's checksums: the owner
                                                   verifies its copy (``check``) and drops it if bad
    <- {"key": kj, "miss": "reason"}               unit j is absent/corrupt/busy: the stream ends
    <- {"end": true}                               after the last unit or a miss
    -> {"op": "ping"}  <- {"pong": true}

Slots not returned when the connection closes (the requester died) are reclaimed at once. A
requester silent for ``idle_timeout_s`` while it owes a line (its request, a ``done``) is cut off
and its slots reclaimed; the owner's own wait for a unit's read or a free slot does not count. Every
line is validated (pydantic models below, both directions): a malformed request gets
``{"error": "..."}`` and the connection reads on; a malformed answer ends the requester's stream
with ``error`` set.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import socket
import socketserver
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterator, Literal, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

from tutti_cluster.cluster.auth import OWNER, REQUESTER, AuthError, ClusterSecret, new_nonce
from tutti_cluster.cluster.transfer import Pull, TransferNode
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

# The completer may be waiting out a pull's deadline (Mooncake's transfer timeout plus 1 s per GiB).
_TRANSFER_JOIN_S = 10.0
# An owner whose slots are all lent waits this long for one, then answers 'busy'. This wait plus
# the unit's read must stay below the requester's line timeout (StageStream's and ClusterClient's
# timeout_s: 5 s by default, 3 s in the cluster tests): a requester that hears nothing within it
# cuts the owner off as silent (an error; ClusterClient then forgets the owner's node record) while
# the owner is still waiting on its behalf.
SLOT_TIMEOUT_S = 2.0
MAX_LINE = 16 << 20  # a stage request of 4096 keys is ~100 KiB; anything far larger is an error
MAX_KEYS = 1 << 20
PROTOCOL = "tutti-stage/1"
AUTH_TIMEOUT_S = 3.0  # an unauthenticated connection's whole handshake, on the owner's side
MAX_HANDSHAKES = 64  # connections in their handshake at once; more are closed at once
HANDSHAKE_LINE = 1024  # a handshake line is ~200 bytes
REFUSAL_LOG_S = 10.0  # refused handshakes: at most one warning line per this many seconds

_U64 = (1 << 64) - 1
_Key = Annotated[int, Field(ge=0, le=_U64)]
_Addr = Annotated[int, Field(ge=0, le=_U64)]
_Hex32 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class _Line(BaseModel):
    # strict: a key is a JSON integer, not "7", 7.0 or true; extra fields are mistakes.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    def line(self) -> bytes:
        return self.model_dump_json().encode() + b"\n"


class StageOp(_Line):
    op: Literal["stage"] = "stage"
    keys: Annotated[list[_Key], Field(max_length=MAX_KEYS)]
    window: Annotated[int, Field(ge=1)] = 2


class DoneOp(_Line):
    op: Literal["done"] = "done"
    addr: _Addr


class CorruptOp(_Line):
    op: Literal["corrupt"] = "corrupt"
    key: _Key


class PingOp(_Line):
    op: Literal["ping"] = "ping"


class Announce(_Line):
    key: _Key
    addr: _Addr
    len: Annotated[int, Field(gt=0, le=1 << 40)]


class Miss(_Line):
    key: _Key
    miss: str


class End(_Line):
    end: Literal[True] = True


class Failure(_Line):
    error: str


class Pong(_Line):
    pong: Literal[True] = True


class Hello(_Line):
    """The owner's first line on every connection: its nonce for this connection."""
    hello: Literal["tutti-stage/1"] = "tutti-stage/1"  # PROTOCOL
    nonce: _Hex32


class AuthOp(_Line):
    """The requester's first line: its nonce and its proof of the credential."""
    op: Literal["auth"] = "auth"
    nonce: _Hex32
    proof: _Hex32


class Welcome(_Line):
    """The owner's proof of the credential, once the requester's verified."""
    proof: _Hex32


_REQUEST: TypeAdapter[StageOp | DoneOp | CorruptOp | PingOp] = TypeAdapter(
    Annotated[Union[StageOp, DoneOp, CorruptOp, PingOp], Field(discriminator="op")])
_ANSWER: TypeAdapter[Announce | Miss | End | Failure] = TypeAdapter(Union[Announce, Miss, End, Failure])


def _why(exc: ValidationError) -> str:
    """The first complaint of a validation error, in one short line."""
    e = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in e["loc"])
    return f"{where + ': ' if where else ''}{e['msg']}"[:200]


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, run at its first call only."""
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            fn()

    return call


def _host_port(address: str) -> tuple[str, int]:
    """``host:port`` (as a node record names a stage endpoint); ValueError for anything else."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a host:port address: {address[:100]!r}")
    return host, int(port)


class _Lines:
    """Lines from a connection, both ends' reader; on the owner's end a read timeout may pass
    without ending the connection: a timed-out ``socket.makefile`` reader refuses every later read,
    so this one keeps its own buffer.
    ``next(idle)`` is one line of at most MAX_LINE bytes, b"" for a longer one (read to its end,
    bounded memory), None at the end of the stream; a read timeout raises only while ``idle()``."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = bytearray()
        self.skipping = False  # inside a line longer than MAX_LINE

    def next(self, idle: Callable[[], bool]) -> bytes | None:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                line = bytes(self.buf[:i + 1])
                del self.buf[:i + 1]
                if self.skipping or len(line) > MAX_LINE:
                    self.skipping = False
                    return b""
                return line
            if len(self.buf) > MAX_LINE:
                self.skipping = True
                self.buf.clear()
            try:
                chunk = self.conn.recv(1 << 16)
            except TimeoutError:
                if idle():
                    raise
                continue
            if not chunk:  # the end: what is left is a last line without its newline
                line, self.buf = bytes(self.buf), bytearray()
                if self.skipping:
                    self.skipping = False
                    return b""
                return line or None
            self.buf += chunk


def _handshake_line(conn: socket.socket, buf: bytearray, deadline: float) -> bytes:
    """One handshake line (at most HANDSHAKE_LINE bytes) by ``deadline`` (monotonic), however the
    peer paces its bytes; what follows it stays in ``buf``. TimeoutError when the time is up,
    ConnectionError at the end of the stream, AuthError for a line too long."""
    while (i := buf.find(b"\n")) < 0:
        if len(buf) > HANDSHAKE_LINE:
            raise AuthError(f"a handshake line longer than {HANDSHAKE_LINE} bytes")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no whole handshake line in the time allowed")
        conn.settimeout(left)
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        buf += chunk
    line = bytes(buf[:i + 1])
    del buf[:i + 1]
    return line


def _requester_handshake(sock: socket.socket, secret: ClusterSecret, timeout_s: float) -> bytearray:
    """The requester's side of the handshake (see the module docstring), within ``timeout_s``:
    returns the bytes read past it. AuthError when the owner refuses our proof or fails to prove
    its own; OSError for the connection's faults."""
    deadline = time.monotonic() + timeout_s
    buf = bytearray()
    line = _handshake_line(sock, buf, deadline)
    try:
        hello = Hello.model_validate_json(line)
    except ValidationError as exc:
        raise AuthError(f"no stage handshake from the owner: {_why(exc)}") from None
    theirs, mine = bytes.fromhex(hello.nonce), new_nonce()
    sock.sendall(AuthOp(nonce=mine.hex(), proof=secret.prove(REQUESTER, theirs, mine).hex()).line())
    line = _handshake_line(sock, buf, deadline)
    try:
        welcome = Welcome.model_validate_json(line)
    except ValidationError as exc:
        try:
            refusal = Failure.model_validate_json(line).error
        except ValidationError:
            raise AuthError(f"bad handshake answer from the owner: {_why(exc)}") from None
        raise AuthError(f"the owner refused our cluster credential ({refusal[:100]})") from None
    if secret.verify_proof(bytes.fromhex(welcome.proof), OWNER, theirs, mine) is None:
        raise AuthError("the owner did not prove the cluster credential")
    sock.settimeout(timeout_s)
    return buf


def _connect(stage_addr: str, secret: ClusterSecret, timeout_s: float) -> tuple[socket.socket, bytearray]:
    """An authenticated connection to a stage endpoint, and the bytes read past the handshake."""
    sock = socket.create_connection(_host_port(stage_addr), timeout=timeout_s)
    try:
        return sock, _requester_handshake(sock, secret, timeout_s)
    except BaseException:
        sock.close()
        raise


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

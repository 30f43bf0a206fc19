"""The stage protocol's wire: a tiny TCP JSON-lines protocol that asks an owner node to stage cache units.

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

import socket
import time
from typing import Annotated, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

from tutti_cluster.cluster.auth import OWNER, REQUESTER, AuthError, ClusterSecret, new_nonce

MAX_LINE = 16 << 20  # a stage request of 4096 keys is ~100 KiB; anything far larger is an error
MAX_KEYS = 1 << 20
PROTOCOL = "tutti-stage/1"
HANDSHAKE_LINE = 1024  # a handshake line is ~200 bytes

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

"""The cluster credential, and what it authenticates: stage connections and directory records.

Every node daemon of a cluster, and every engine process that fetches from it, holds the same
secret (``cluster_secret_file``: at least 32 random bytes, e.g. 64 hex digits, in a file of mode
0600 or stricter). It is never sent anywhere; each use is an HMAC-SHA256 (stdlib :mod:`hmac`,
compared with :func:`hmac.compare_digest`) over a message that names what it is for:

- **Stage connections** (:mod:`.stage`): the owner sends a fresh 32-byte nonce, the requester
  answers with its own nonce and ``HMAC(secret, "stage" | "requester" | owner nonce | requester nonce)``,
  and the owner, once that verifies, proves itself with the same over ``"owner"``. Only then is a
  request read. A captured handshake is worth nothing on another connection: the owner's nonce is
  new on each one, and the two directions' proofs differ, so neither can be reflected.
- **Directory records** (:mod:`.directory`): each node record and each unit entry in etcd carries
  ``HMAC(secret, kind | etcd lease | etcd key [| record])``; lookups ignore (and count) whatever does
  not verify. The lease binds a record to its writer's life: an old record of a node cannot be put
  back once that lease is gone (etcd refuses a put under a dead lease).

A file may hold several secrets, one a line: the first signs and proves, every line is accepted.
That is how the credential is rotated without stopping the cluster (docs/SECURITY.md).
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path
from typing import Any, Sequence

from tutti_cluster.errors import ConfigError, StorageError, TuttiError
from tutti_cluster.files import read_credential

MIN_SECRET_BYTES = 32
MAX_FILE_BYTES = 64 << 10  # a handful of secrets; anything far larger is not a key file
KEY_FILE_NAME = "cluster.key"  # what a single node makes in its data directory
NONCE_BYTES = 32
UNIT_MAC_BYTES = 16  # a unit entry's value: HMAC-SHA256 truncated to 128 bits

# Labels: each MAC says what it is for (a proof of one kind never passes as another).
_STAGE = b"tutti/stage/v1\0"
_NODE = b"tutti/node/v1\0"
_UNIT = b"tutti/unit/v1\0"
REQUESTER = b"requester"
OWNER = b"owner\0\0\0\0"  # as long as REQUESTER: the message layout is fixed

HOW_TO_MAKE = ("make one with `tutti cluster-key PATH` (or: python -c \"import secrets; "
               "print(secrets.token_hex(32))\" > PATH; chmod 600 PATH) and give every node and engine the same file")


class AuthError(TuttiError):
    """A peer did not prove the cluster credential (or refused ours)."""


class ClusterSecret:
    """The cluster credential: one or more secrets; the first is used, every one is accepted."""

    __slots__ = ("_keys", "source")

    def __init__(self, keys: Sequence[bytes], source: str = "") -> None:
        keys = [bytes(k) for k in keys]
        if not keys:
            raise ConfigError(f"the cluster credential{' in ' + source if source else ''} holds no secret")
        for k in keys:
            if len(k) < MIN_SECRET_BYTES:
                raise ConfigError(f"a cluster secret{' in ' + source if source else ''} has {len(k)} bytes; at "
                                  f"least {MIN_SECRET_BYTES} random bytes are needed ({HOW_TO_MAKE})")
        self._keys = tuple(keys)
        self.source = source

    def __repr__(self) -> str:  # never the secret itself
        return f"ClusterSecret({self.source or 'in memory'}, {len(self._keys)} secret(s))"

    @classmethod
    def generate(cls) -> "ClusterSecret":
        """A fresh random secret held in memory only (tests, benchmarks)."""
        return cls([secrets.token_hex(32).encode()], "generated")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "ClusterSecret":
        """The secrets in ``path``, one a line (surrounding blanks and empty lines ignored).

        ConfigError when the file is missing, is not a regular file, is readable or writable by its
        group or others, is larger than 64 KiB, or holds a secret shorter than 32 bytes."""
        return cls(_secret_lines(read_secret_file(path), path), str(path))

    # -- MACs -----------------------------------------------------------------------------------
    def mac(self, msg: bytes) -> bytes:
        return hmac.digest(self._keys[0], msg, "sha256")

    def check(self, tag: bytes, msg: bytes, size: int = 32) -> int | None:
        """Index of the secret whose MAC of ``msg`` (first ``size`` bytes) is ``tag``, else None."""
        if len(tag) != size:
            return None
        for i, k in enumerate(self._keys):
            if hmac.compare_digest(hmac.digest(k, msg, "sha256")[:size], tag):
                return i
        return None

    # -- stage handshake --------------------------------------------------------------------------
    def prove(self, role: bytes, owner_nonce: bytes, requester_nonce: bytes, index: int = 0) -> bytes:
        """``role``'s proof on one connection, with secret ``index`` (the owner answers with the one
        the requester's proof verified against)."""
        return hmac.digest(self._keys[index], _STAGE + role + owner_nonce + requester_nonce, "sha256")

    def verify_proof(self, proof: bytes, role: bytes, owner_nonce: bytes, requester_nonce: bytes) -> int | None:
        return self.check(proof, _STAGE + role + owner_nonce + requester_nonce)

    # -- directory records --------------------------------------------------------------------------
    def sign_unit(self, etcd_key: bytes, lease: int) -> bytes:
        return self.mac(_UNIT + _u64(lease) + etcd_key)[:UNIT_MAC_BYTES]

    def unit_ok(self, value: bytes, etcd_key: bytes, lease: int) -> bool:
        """Whether a unit entry's value is its MAC. Fast path first: most entries are signed
        with the first secret."""
        if len(value) != UNIT_MAC_BYTES:
            return False
        msg = _UNIT + _u64(lease) + etcd_key
        if hmac.compare_digest(hmac.digest(self._keys[0], msg, "sha256")[:UNIT_MAC_BYTES], value):
            return True
        return len(self._keys) > 1 and self.check(value, msg, UNIT_MAC_BYTES) is not None

    def sign_record(self, etcd_key: bytes, lease: int, body: bytes) -> str:
        return self.mac(_record_msg(etcd_key, lease, body)).hex()

    def record_ok(self, sig: Any, etcd_key: bytes, lease: int, body: bytes) -> bool:
        if not isinstance(sig, str) or len(sig) != 64:
            return False
        try:
            tag = bytes.fromhex(sig)
        except ValueError:
            return False
        return self.check(tag, _record_msg(etcd_key, lease, body)) is not None


def _u64(n: int) -> bytes:
    return (int(n) & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")


def _record_msg(etcd_key: bytes, lease: int, body: bytes) -> bytes:
    return _NODE + _u64(lease) + len(etcd_key).to_bytes(4, "big") + etcd_key + body


def _secret_lines(raw: bytes, path: Any) -> list[bytes]:
    keys = [line.strip() for line in raw.splitlines()]
    keys = [k for k in keys if k]
    if not keys:
        raise ConfigError(f"the cluster secret file {path} is empty ({HOW_TO_MAKE})")
    return keys


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the cluster credential file (``files.read_credential``): a regular file (a
    symbolic link to one is followed, as Kubernetes mounts Secrets) of at most 64 KiB that neither
    its group nor others may read or write. Opened without blocking, so that a FIFO never hangs
    the caller."""
    try:
        return read_credential(path, "the cluster secret file", MAX_FILE_BYTES, private=True)
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({HOW_TO_MAKE})") from None


def write_secret_file(path: str | os.PathLike[str]) -> Path:
    """Make a new credential file at ``path``: 64 random hex digits, mode 0600. Never replaces
    or follows anything already there (O_EXCL | O_NOFOLLOW): StorageError if the path exists."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except FileExistsError:
        raise StorageError(f"{path} already exists: a cluster secret file is never overwritten") from None
    except OSError as exc:
        raise StorageError(f"cannot create the cluster secret file {path}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)  # never leave an empty credential behind
        raise StorageError(f"cannot write the cluster secret file {path}: {exc.strerror or exc}") from None
    os.close(fd)
    return path


def ensure_secret_file(path: str | os.PathLike[str]) -> tuple[ClusterSecret, bool]:
    """The credential in ``path``, made first if there is none: (secret, whether it was just made)."""
    try:
        write_secret_file(path)
        made = True
    except StorageError:
        if not os.path.lexists(path):
            raise
        made = False
    return ClusterSecret.from_file(path), made


def cluster_secret(config: Any) -> ClusterSecret:
    """The cluster credential of ``config`` (``cluster_secret_file``); ConfigError, saying how to make
    one, when none is set: cluster mode never runs without it."""
    path = getattr(config, "cluster_secret_file", None)
    if path is None:
        raise ConfigError("cluster mode needs the cluster credential: set cluster_secret_file "
                          f"(--cluster-secret-file, TUTTI_CLUSTER_SECRET_FILE); {HOW_TO_MAKE}")
    return ClusterSecret.from_file(path)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)

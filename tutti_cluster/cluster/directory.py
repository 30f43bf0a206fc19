"""Cluster directory of cache-unit replicas, kept in etcd under the ``tutti/`` prefix.

Layout (all keys bound to the owning node's lease, so a dead node's entries vanish with its lease):

- ``tutti/n/<node_id>``: JSON node record ``{"node_id", "segment", "stage", "pid"}``: the node's
  Transfer Engine segment name (``host:rpc_port``, Mooncake P2P handshake) and the address of its
  stage endpoint (see :mod:`tutti_cluster.cluster.stage`).
- ``tutti/u/<key as 16 hex digits>/<node_id>``: one per replica of a cache unit; its value is the
  entry's signature (below).

Records are bound to the cluster credential (:mod:`.auth`): a node record carries ``"sig"``, an
HMAC-SHA256 over its etcd key, its lease and its other fields (canonical JSON), and a unit entry's
value is a 16-byte HMAC over its etcd key and lease. Every lookup checks them and ignores (and
counts, ``stats.unverified``) whatever does not verify, so that a writer with access to etcd but
not the credential can neither make a node advertise keys it does not hold nor point requesters
at another address. Signatures rather than etcd's own access control, because they hold whatever
etcd's configuration (a shared etcd, one without RBAC, a member's backup restored elsewhere) and
against anyone who can write to etcd without holding the credential; etcd's TLS and users
(:class:`~tutti_cluster.cluster.etcd.EtcdSecurity`) add to that, they do not replace it. The lease
in the signature is etcd's own (``KeyValue.lease``): a record of a node's earlier life cannot be put
back, since etcd refuses a put under a lease that is gone. What remains: a writer with etcd access
can delete entries (misses), and can put back an entry the node removed during its current lease
(the owner then answers a miss for it: never wrong data, which the requester's checksums and key
check exclude anyway).

A lookup of N keys is one etcd transaction of N range reads (one per key prefix), so one round trip;
batches above ``max_txn_ops`` are split into several transactions sent at once (still about one
round trip of wall time, and etcd serves concurrent read transactions in parallel). The client uses
1024 operations per transaction (start etcd with ``--max-txn-ops 1024`` or more) and shrinks the
chunks by itself when etcd refuses them (etcd's default limit is 128).

The etcd client is :mod:`tutti_cluster.cluster.etcd` (the maintained ``python3-etcd3`` client, with
channel options that reconnect within seconds after an outage).

Every call that talks to etcd is best effort with a deadline: when etcd is unreachable a lookup
reports misses and a registration is remembered and replayed by the keepalive thread once etcd is
back (also after etcd lost its data: a lease that the server no longer knows is replaced and all
local replicas are written again).
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, StringConstraints

from tutti_cluster.cluster.etcd import (EtcdAuthError, EtcdClient, EtcdError, EtcdSecurity, KeyValue, op_delete,
                                        op_put, op_range, prefix_end)
from tutti_cluster.cluster.auth import ClusterSecret
from tutti_cluster.errors import ConfigError

log = logging.getLogger(__name__)

PREFIX = "tutti/"
NODE_PREFIX = PREFIX + "n/"
# A node id: the last part of its keys in etcd, read back by other nodes (U+FFFD is what an
# undecodable key reads as, so no id may hold it).
NODE_ID_MAX = 253
NODE_ID_PATTERN = f"[^/\ufffd]{{1,{NODE_ID_MAX}}}"
_NODE_ID = re.compile(NODE_ID_PATTERN)
UNIT_PREFIX = PREFIX + "u/"
# Unit entries verified once are remembered by their etcd key and the revision of the put that
# wrote them (etcd gives every put a new one, so a rewritten entry is verified again): a lookup of
# entries seen before costs a dictionary probe each, not an HMAC. Cleared when it holds this many.
VERIFIED_ENTRIES = 1 << 16


def unit_key(key: int, node_id: str = "") -> str:
    """The etcd key of a replica of cache unit ``key`` on ``node_id`` (or the prefix of all replicas)."""
    return f"{UNIT_PREFIX}{key & 0xFFFFFFFFFFFFFFFF:016x}/{node_id}"


def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """``"host:port,host:port"`` (an ``http://`` scheme is allowed) to a list of (host, port)."""
    out: list[tuple[str, int]] = []
    for part in endpoints.split(","):
        part = part.strip()
        if not part:
            continue
        if "://" in part:
            part = part.split("://", 1)[1]
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"etcd endpoint {part!r} is not host:port")
        out.append((host, int(port)))
    if not out:
        raise ConfigError("no etcd endpoint given")
    return out


def local_address_towards(endpoints: str) -> str:
    """This host's address on the route to the first etcd endpoint.

    That is the address other nodes can reach us at (they reach the same etcd), without another
    setting: 127.0.0.1 when etcd runs on loopback, the node's routable address otherwise. Nothing is
    sent (a UDP socket only picks the route). Raises ConfigError when there is no route (a host
    name that does not resolve, an unreachable network), rather than advertising 127.0.0.1.
    """
    host, port = parse_endpoints(endpoints)[0]
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError as exc:
        # Never fall back to 127.0.0.1 silently: other nodes would be told to dial themselves.
        raise ConfigError(f"cannot tell which address to advertise to other nodes: no route to etcd host "
                          f"{host!r} ({exc.strerror or exc}); set advertise_host (--advertise-host, "
                          "TUTTI_ADVERTISE_HOST)") from None


def advertised_host(config: Any) -> str:
    """The address this node listens on and gives other nodes: ``config.advertise_host``, which
    must resolve, or else the address on the route to etcd (:func:`local_address_towards`)."""
    host = getattr(config, "advertise_host", None)
    if not host:
        return local_address_towards(",".join(config.etcd))
    try:
        socket.getaddrinfo(host, None)
    except OSError as exc:
        raise ConfigError(f"advertise_host {host!r} does not resolve ({exc.strerror or exc})") from None
    return str(host)


@dataclass
class DirectoryStats:
    """Counters (never log lines) for the hot paths."""

    lookups: int = 0
    lookup_keys: int = 0
    lookup_errors: int = 0
    lookups_skipped: int = 0  # while etcd is known to be down (back-off)
    registered: int = 0
    unregistered: int = 0
    put_errors: int = 0
    resyncs: int = 0
    lease_renewals: int = 0
    leases_granted: int = 0
    bad_records: int = 0  # node records or unit entries in etcd that do not parse: skipped
    unverified: int = 0  # node records or unit entries whose signature does not verify: ignored

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class NodeRecord:
    node_id: str
    segment: str
    stage: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"node_id": self.node_id, "segment": self.segment, "stage": self.stage, **self.extra})

    def _body(self) -> bytes:
        """The fields a signature covers, as canonical JSON (sorted keys, no blanks)."""
        fields = {**self.extra, "node_id": self.node_id, "segment": self.segment, "stage": self.stage}
        fields.pop("sig", None)
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def signed(self, secret: ClusterSecret, etcd_key: bytes, lease: int) -> bytes:
        """The record as written to etcd: its JSON with ``"sig"``, bound to its key and lease."""
        d = json.loads(self.to_json())
        d["sig"] = secret.sign_record(etcd_key, lease, self._body())
        return json.dumps(d).encode()

    def verified(self, secret: ClusterSecret, etcd_key: bytes, lease: int) -> bool:
        """Whether this record (as read back, ``"sig"`` in :attr:`extra`) was signed for this key and lease."""
        return secret.record_ok(self.extra.get("sig"), etcd_key, lease, self._body())

    @staticmethod
    def from_json(raw: bytes | str) -> "NodeRecord":
        """Parses a record as :meth:`to_json` writes it; ValueError (pydantic's ValidationError)
        for anything else."""
        d = _NodeRecordModel.model_validate_json(raw)
        return NodeRecord(d.node_id, d.segment, d.stage, dict(d.model_extra or {}))


class _NodeRecordModel(BaseModel):
    # What other nodes wrote into etcd: checked before use, extra fields (pid, advertised ports) kept.
    model_config = ConfigDict(extra="allow", strict=True)
    node_id: Annotated[str, StringConstraints(pattern=f"^{NODE_ID_PATTERN}$")]
    segment: Annotated[str, StringConstraints(max_length=300)] = ""
    stage: Annotated[str, StringConstraints(max_length=300)] = ""


class EtcdDirectory:
    """The replica directory of one node.

    Read-only users (an engine process that only looks up) call :meth:`connect` and :meth:`lookup`;
    the node daemon also calls :meth:`start` (lease, node record, keepalive thread),
    :meth:`register` and :meth:`unregister`.

    Contracts: no method raises because etcd is down or slow; each gives up after ``timeout_s`` and
    records the failure in :attr:`stats`. Registrations made while etcd is away are replayed.
    """

    def __init__(self, endpoints: str, node_id: str, lease_ttl_s: int = 10, timeout_s: float = 2.0,
                 max_txn_ops: int = 1024, security: EtcdSecurity | None = None, *, secret: ClusterSecret) -> None:
        """``secret``: the cluster credential, which signs this node's records and verifies others'."""
        if not isinstance(secret, ClusterSecret):
            raise TypeError("EtcdDirectory needs the cluster credential (a ClusterSecret)")
        self.secret = secret
        if not isinstance(node_id, str) or not _NODE_ID.fullmatch(node_id):
            raise ConfigError(f"node_id must be 1 to {NODE_ID_MAX} characters, none of them '/' or U+FFFD: "
                              f"{str(node_id)[:300]!r}")
        if lease_ttl_s < 2:
            raise ConfigError(f"lease_ttl_s must be at least 2 seconds, got {lease_ttl_s}")
        if max_txn_ops < 1:
            raise ConfigError("max_txn_ops must be positive")
        self.endpoints = parse_endpoints(endpoints)
        # TLS and user authentication (EtcdSecurity.from_config); an https:// endpoint turns TLS on.
        self.security = (security or EtcdSecurity()).for_endpoints(endpoints)
        self.node_id = node_id
        self.lease_ttl_s = int(lease_ttl_s)
        self.timeout_s = timeout_s
        self.max_txn_ops = max_txn_ops
        self.stats = DirectoryStats()
        self._client: EtcdClient | None = None
        self._ep_index = 0
        self._lock = threading.RLock()      # guards _local, _lease, _dirty, _record
        self._local: set[int] = set()
        self._lease: int | None = None
        self._record: NodeRecord | None = None
        self._dirty = False
        self._pending_deletes: set[int] = set()  # evictions etcd did not take yet
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._down_until = 0.0  # lookups are skipped until then after a failure (back-off)
        self._backoff = 0.0
        self._nodes: dict[str, NodeRecord] = {}
        self._bad_keys: set[bytes] = set()  # node records skipped once (warned about once)
        self._unverified_logged: float | None = None  # unit entries that fail verification: one warning a minute
        self._verified: dict[bytes, int] = {}  # unit entries verified: etcd key -> mod_revision (VERIFIED_ENTRIES)
        self._unverified_unlogged = 0
        self._nodes_at = 0.0
        self._wake = threading.Event()  # the keepalive thread's sleep, cut short when etcd is back
        self._down_since: float | None = None  # etcd unreachable since (monotonic), for the log lines
        self._down_logged = 0.0
        self._last_error: BaseException | None = None  # of the last failed resync

    # -- connection -------------------------------------------------------------------------------
    def connect(self) -> None:
        """Create the gRPC channel (lazy: succeeds even when etcd is down)."""
        host, port = self.endpoints[self._ep_index % len(self.endpoints)]
        self._client = EtcdClient(f"{host}:{port}", timeout_s=self.timeout_s, security=self.security)
        self._client.on_ready(self._etcd_ready)

    def _etcd_ready(self) -> None:
        """The channel (re)connected: end the lookup back-off and let the keepalive thread re-register now."""
        self._down_until = 0.0
        self._backoff = 0.0
        self._wake.set()

    # Visible, not noisy: one warning when etcd stops answering, one every 30 s while it stays
    # away, one line when it answers again (the failures themselves are counted in ``stats``).
    def _note_down(self, exc: BaseException) -> None:
        now = time.monotonic()
        endpoint = self._client.endpoint if self._client is not None else "?"
        # A refused handshake, user or permission is said as such (the error names the setting to check).
        state = "refuses this node" if isinstance(exc, EtcdAuthError) else "unreachable"
        if self._down_since is None:
            self._down_since = self._down_logged = now
            log.warning("etcd %s %s (%s): retrying; lookups of other nodes' units miss and this node's "
                        "registrations wait until it answers", endpoint, state, exc)
        elif now - self._down_logged >= 30.0:
            self._down_logged = now
            log.warning("etcd %s still %s after %.0f s (%s): retrying", endpoint, state, now - self._down_since, exc)

    def _note_up(self) -> None:
        if self._down_since is not None:
            log.info("etcd %s answers again after %.1f s", self.client.endpoint, time.monotonic() - self._down_since)
            self._down_since = None

    def _rotate(self) -> None:
        """After a failure, move to the next endpoint (a multi-member etcd keeps serving)."""
        if len(self.endpoints) > 1:
            self._ep_index += 1
            if self._client is not None:
                self._client.close()
            self.connect()

    @property
    def client(self) -> EtcdClient:
        if self._client is None:
            self.connect()
        assert self._client is not None
        return self._client

    # -- node lifecycle ---------------------------------------------------------------------------
    def start(self, record: NodeRecord) -> None:
        """Publish this node under a fresh lease and start the keepalive thread.

        Does not fail when etcd is down: the keepalive thread keeps trying and publishes the node
        and every registered replica once etcd answers. Raises :class:`EtcdAuthError` when etcd
        answers but refuses this node (TLS handshake, user, password, role).
        """
        if record.node_id != self.node_id:
            raise ConfigError("node record belongs to another node")
        with self._lock:
            self._record = record
            self._dirty = True
        if not self._resync() and isinstance(self._last_error, EtcdAuthError):
            # etcd answers but refuses this node (TLS handshake, user, role): a setting to fix, not an
            # outage to wait out, so the node does not start.
            raise self._last_error
        self._thread = threading.Thread(target=self._keepalive_loop, name="tutti-etcd-keepalive", daemon=True)
        self._thread.start()

    def stop(self, revoke: bool = True) -> None:
        """Stop the keepalive; with ``revoke`` the node's entries disappear at once."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1)
        if revoke and self._lease is not None:
            try:
                self.client.lease_revoke(self._lease)
            except Exception as exc:
                log.info("could not revoke lease on stop (entries expire with the TTL): %s", exc)
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None

    def _grant(self) -> int:
        lease = self.client.lease_grant(self.lease_ttl_s)
        self.stats.leases_granted += 1
        log.info("node %s holds etcd lease %x (ttl %d s)", self.node_id, lease, self.lease_ttl_s)
        return lease

    def _resync(self) -> bool:
        """(Re)write the node record and every local replica under a valid lease. True on success."""
        with self._lock:
            if self._record is None:
                return False
            keys = sorted(self._local)
            deletes = sorted(self._pending_deletes)
            record = self._record
        try:
            if self._lease is None:
                self._lease = self._grant()
            lease = self._lease
            node_key = (NODE_PREFIX + self.node_id).encode()
            self.client.put(node_key, record.signed(self.secret, node_key, lease), lease=lease)
            self._delete_keys(deletes)
            self._put_keys(keys, lease)
        except Exception as exc:
            self.stats.put_errors += 1
            self._last_error = exc
            self._note_down(exc)
            self._rotate()
            return False
        self._note_up()
        with self._lock:
            # Keys registered during the resync were written by register() itself (or set _dirty).
            self._dirty = False
            self._pending_deletes.difference_update(deletes)
        self.stats.resyncs += 1
        log.info("node %s published with %d replicas", self.node_id, len(keys))
        return True

    def _keepalive_loop(self) -> None:
        period = max(0.5, self.lease_ttl_s / 3.0)
        while True:
            self._wake.wait(period)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self._lease is None:
                    self._resync()
                    continue
                ttl = self.client.lease_keepalive(self._lease)
                self.stats.lease_renewals += 1
                self._note_up()
                if ttl <= 0:
                    # The server no longer knows the lease (it expired while we were cut off, or
                    # etcd lost its data): take a new one and write everything again.
                    log.warning("etcd lease %x is gone; re-registering node %s", self._lease, self.node_id)
                    self._lease = None
                    self._resync()
                elif self._dirty:
                    self._resync()
            except Exception as exc:
                self._note_down(exc)
                with self._lock:
                    self._dirty = True
                self._rotate()

    # -- replicas ---------------------------------------------------------------------------------
    def _run(self, ops: Sequence[bytes]) -> list[list[KeyValue] | None]:
        """Run ``ops`` in transactions of at most ``max_txn_ops``, sent concurrently.

        etcd refuses transactions above its ``--max-txn-ops`` (128 by default); on that answer the
        chunk size shrinks (once per directory, remembered) and the call is retried.
        """
        while True:
            n = self.max_txn_ops
            try:
                res = self.client.txn_many([ops[i:i + n] for i in range(0, len(ops), n)])
                return [r for chunk in res for r in chunk]
            except EtcdError as exc:
                if not exc.too_many_ops or n == 1:
                    raise
                self.max_txn_ops = max(1, min(128, n // 2))
                log.warning("etcd refuses %d operations per transaction; using %d", n, self.max_txn_ops)

    def _put_keys(self, keys: Sequence[int], lease: int) -> None:
        ops = []
        for k in keys:
            ek = unit_key(k, self.node_id).encode()
            ops.append(op_put(ek, self.secret.sign_unit(ek, lease), lease))
        self._run(ops)

    def _delete_keys(self, keys: Sequence[int]) -> None:
        self._run([op_delete(unit_key(k, self.node_id).encode()) for k in keys])

    def register(self, keys: Iterable[int]) -> bool:
        """Record local replicas of ``keys``; True if etcd has them now, False if queued for replay."""
        ks = [int(k) & 0xFFFFFFFFFFFFFFFF for k in keys]
        if not ks:
            return True
        with self._lock:
            self._local.update(ks)
            self._pending_deletes.difference_update(ks)
            lease = self._lease
            if lease is None or self._dirty:
                self._dirty = True
                return False
        try:
            self._put_keys(ks, lease)
            self.stats.registered += len(ks)
            return True
        except Exception as exc:
            self.stats.put_errors += 1
            log.debug("register of %d keys deferred: %s", len(ks), exc)
            with self._lock:
                self._dirty = True
            return False

    def unregister(self, keys: Iterable[int]) -> bool:
        """Drop local replicas of ``keys`` (eviction); True if etcd has dropped them too.

        When etcd is away the deletion is queued and replayed with the next resync (or the entries
        expire with the lease, whichever comes first).
        """
        ks = [int(k) & 0xFFFFFFFFFFFFFFFF for k in keys]
        if not ks:
            return True
        with self._lock:
            self._local.difference_update(ks)
        try:
            self._delete_keys(ks)
            self.stats.unregistered += len(ks)
            return True
        except Exception as exc:
            self.stats.put_errors += 1
            log.debug("unregister of %d keys failed: %s", len(ks), exc)
            with self._lock:
                self._dirty = True
                self._pending_deletes.update(ks)
            return False

    # -- lookups ----------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int], prefix: bool = True, exclude_self: bool = True) -> list[list[str]]:
        """Owners of each key (node ids), in one transaction per ``max_txn_ops`` keys.

        With ``prefix`` the result stops after the first key without an owner (callers want the hit
        prefix); otherwise one list per key. On any etcd failure the keys not yet answered count as
        misses: a lookup never raises for a cluster fault.
        """
        ks = [int(k) & 0xFFFFFFFFFFFFFFFF for k in keys]
        self.stats.lookups += 1
        self.stats.lookup_keys += len(ks)
        out: list[list[str]] = []
        if not ks:
            return out
        responses: list[list[KeyValue] | None] = []
        if time.monotonic() < self._down_until:
            self.stats.lookups_skipped += 1
        else:
            ops = []
            for k in ks:
                start = unit_key(k).encode()
                ops.append(op_range(start, prefix_end(start)))  # the values: each entry's signature
            try:
                responses = self._run(ops)
                self._backoff = 0.0
                self._note_up()
            except Exception as exc:
                # Back off so that a dead or partitioned etcd costs one deadline, not one per lookup.
                self.stats.lookup_errors += 1
                self._backoff = min(5.0, max(0.25, 2 * self._backoff))
                self._down_until = time.monotonic() + self._backoff
                log.debug("directory lookup failed (treated as misses): %s", exc)
                self._note_down(exc)
                self._rotate()
        unit_ok = self.secret.unit_ok
        verified = self._verified
        unverified = 0
        for kvs in responses:
            owners = []
            for kv in kvs or ():
                node = kv.key.decode(errors="replace").rsplit("/", 1)[-1]
                if not _NODE_ID.fullmatch(node):  # not a key this directory writes
                    self.stats.bad_records += 1
                    continue
                if verified.get(kv.key) != kv.mod_revision:
                    if not unit_ok(kv.value, kv.key, kv.lease):  # not written with the cluster credential
                        unverified += 1
                        continue
                    if len(verified) >= VERIFIED_ENTRIES:
                        verified.clear()
                    verified[kv.key] = kv.mod_revision
                if exclude_self and node == self.node_id:
                    continue
                owners.append(node)
            if prefix and not owners:
                break
            out.append(owners)
        if not prefix:
            out.extend([] for _ in range(len(ks) - len(out)))
        if unverified:
            self._note_unverified(unverified)
        return out

    def _note_unverified(self, n: int) -> None:
        """Count unit entries that failed verification; one warning a minute at most."""
        self.stats.unverified += n
        self._unverified_unlogged += n
        now = time.monotonic()
        if self._unverified_logged is None or now - self._unverified_logged >= 60.0:
            log.warning("ignored %d unit entries in the directory whose signature does not verify (written without "
                        "this cluster's credential, or with another one)", self._unverified_unlogged)
            self._unverified_logged, self._unverified_unlogged = now, 0

    def node(self, node_id: str, max_age_s: float = 30.0) -> NodeRecord | None:
        """The record of ``node_id`` (cached; refreshed when unknown or older than ``max_age_s``)."""
        rec = self._nodes.get(node_id)
        if rec is not None and time.monotonic() - self._nodes_at < max_age_s:
            return rec
        self.refresh_nodes()
        return self._nodes.get(node_id)

    def refresh_nodes(self) -> dict[str, NodeRecord]:
        """Read all node records (one range read); on failure keep the cached ones."""
        try:
            nodes = {}
            for kv in self.client.get_prefix(NODE_PREFIX.encode()):
                # One bad record (another node's bug, a hand-made key) is skipped, not the directory.
                try:
                    rec = NodeRecord.from_json(kv.value)
                except ValueError as exc:
                    rec = None
                    why = str(exc).splitlines()[0]
                else:
                    why = "its node_id is not its key's"
                if rec is not None and kv.key == (NODE_PREFIX + rec.node_id).encode() \
                        and not rec.verified(self.secret, kv.key, kv.lease):
                    self.stats.unverified += 1
                    rec, why = None, "its signature does not verify (not written with this cluster's credential)"
                elif rec is None or kv.key != (NODE_PREFIX + rec.node_id).encode():
                    self.stats.bad_records += 1
                    rec = None
                if rec is None:
                    seen = kv.key in self._bad_keys
                    if len(self._bad_keys) >= 4096:  # bounded: a flood of bad records is warned about again
                        self._bad_keys.clear()
                    self._bad_keys.add(kv.key)
                    (log.debug if seen else log.warning)("skipping the node record under %r: %s", kv.key[:100], why)
                    continue
                rec.extra.pop("sig", None)
                nodes[rec.node_id] = rec
            self._nodes = nodes
            self._nodes_at = time.monotonic()
        except Exception as exc:
            self.stats.lookup_errors += 1
            log.debug("node records unavailable: %s", exc)
        return dict(self._nodes)

    def forget_node(self, node_id: str) -> None:
        """Drop a cached node record (its stage endpoint failed)."""
        self._nodes.pop(node_id, None)

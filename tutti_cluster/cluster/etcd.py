"""The etcd v3 calls the directory needs, over the maintained ``python3-etcd3`` client.

``python3-etcd3`` (import name ``etcd3``) brings etcd's generated protobuf messages and gRPC stubs
and imports beside protobuf 5-7. Leases, puts and prefix reads go through its client; the batched
lookup uses its ``KV`` stub and messages directly, because its ``transaction()`` helper can neither
ask for ``keys_only`` ranges nor send several transactions at once (``Txn.future``).

Two things are set here rather than left to the library's defaults:

- the gRPC channel reconnects with a backoff of 0.5 s growing to 2 s (:data:`GRPC_OPTIONS`).
  gRPC's default grows to 120 s, so after an etcd outage of a minute or two a node found etcd
  again only 10-72 s after it was back, by which time its lease had expired;
- an endpoint that failed once is tried again at once (``time_retry=0``). The library's default
  marks it failed for 300 s, and with a single endpoint every call in that time is refused.

Every call takes the client's deadline; failures raise :class:`EtcdError`.

TLS and authentication (:class:`EtcdSecurity`, from the ``etcd_*`` settings): the channel is TLS when
a CA, a client certificate or an ``https://`` endpoint is given (mutual TLS with a client certificate
and key); with ``etcd_user`` the client authenticates with the password read from
``etcd_password_file`` on its first call and again whenever etcd answers that the token is no longer
valid (tokens expire, and an etcd restart forgets them). The password is sent only in etcd's
``Authenticate`` call and never logged. A handshake that fails, a wrong password or a missing
permission raise :class:`EtcdAuthError` at once (gRPC fails calls fast while a channel cannot
connect, and every call has the deadline), naming the endpoint and the cause.
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import threading
from dataclasses import dataclass, replace
from typing import Any, Sequence

from tutti_cluster.errors import ConfigError, TuttiError
from tutti_cluster.files import read_credential

try:
    import grpc
    from etcd3 import MultiEndpointEtcd3Client, etcdrpc
    from etcd3 import exceptions as etcd3_exceptions
    from etcd3.client import Endpoint
    from etcd3.etcdrpc.kv_pb2 import KeyValue
except ImportError as _exc:  # pragma: no cover - the dependency is declared in pyproject.toml
    _IMPORT_ERROR: ImportError | None = _exc
    KeyValue = object  # type: ignore[misc,assignment]
else:
    _IMPORT_ERROR = None

log = logging.getLogger(__name__)

#: gRPC channel options: reconnect within seconds after an etcd outage (see the module docstring).
GRPC_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2000),
]

__all__ = ["EtcdAuthError", "EtcdClient", "EtcdError", "EtcdSecurity", "GRPC_OPTIONS", "KeyValue", "op_delete",
           "op_put", "op_range", "prefix_end", "read_credential_file"]

#: Largest credential file read (a CA bundle of a few hundred certificates fits).
MAX_CREDENTIAL_BYTES = 1 << 20
# What gRPC's details say when a TLS handshake fails or the peer rejects it right after (etcd with
# --client-cert-auth answers a client without a certificate with an alert: "Unwrap failed").
_TLS_FAILURE = re.compile(r"handshake|TSI_|SSL|certificate|Unwrap failed", re.IGNORECASE)


class EtcdError(TuttiError):
    """etcd did not answer, or answered with an error (``code``: the gRPC status name)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code

    @property
    def too_many_ops(self) -> bool:
        """etcd refused a transaction above its ``--max-txn-ops``."""
        return "too many operations" in str(self)


class EtcdAuthError(EtcdError):
    """etcd refused this client: the TLS handshake failed (CA, client certificate), the user or
    password is wrong, or the user lacks a permission. Retrying does not help until the settings
    (or etcd's users and roles) change."""


def read_credential_file(path: str | os.PathLike[str], setting: str, limit: int = MAX_CREDENTIAL_BYTES,
                         private: bool = False) -> bytes:
    """The bytes of a credential file named by ``setting`` (``files.read_credential``): a key or a
    password (``private``) must be owner-only, a CA or certificate may be shared."""
    return read_credential(path, setting, limit, private=private)


def _no_passphrase(*_: Any) -> bytes:
    raise ConfigError("etcd_key_file is encrypted: give an unencrypted key (gRPC takes no passphrase)")


@dataclass(frozen=True, repr=False)
class EtcdSecurity:
    """TLS and user authentication of the etcd connection, read once from the files.

    ``tls``: a TLS channel (``ca`` None: the system's CA certificates verify etcd's); ``cert`` and
    ``key``: the client certificate of mutual TLS; ``user`` and ``password``: etcd's user (role-based
    access control).
    """

    tls: bool = False
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    user: str | None = None
    password: str | None = None

    def __repr__(self) -> str:  # never the password or the key
        return (f"EtcdSecurity(tls={self.tls}, ca={self.ca is not None}, client_cert={self.cert is not None}, "
                f"user={self.user!r})")

    @classmethod
    def from_config(cls, config: Any) -> "EtcdSecurity":
        """From ``etcd_ca_file``, ``etcd_cert_file``, ``etcd_key_file``, ``etcd_user`` and
        ``etcd_password_file`` (and ``https://`` endpoints in ``etcd``). ConfigError when a file is
        missing, unreadable, not a regular file, not PEM, or the certificate and key do not match."""
        ca_file = getattr(config, "etcd_ca_file", None)
        cert_file = getattr(config, "etcd_cert_file", None)
        key_file = getattr(config, "etcd_key_file", None)
        user = getattr(config, "etcd_user", None) or None
        password_file = getattr(config, "etcd_password_file", None)
        if (cert_file is None) != (key_file is None):
            raise ConfigError("etcd_cert_file and etcd_key_file go together (the client certificate and its key)")
        if (user is None) != (password_file is None):
            raise ConfigError("etcd_user and etcd_password_file go together (etcd's user and the file holding "
                              "its password)")
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # parses the PEM files as gRPC will use them
        ca = cert = key = None
        if ca_file is not None:
            ca = read_credential_file(ca_file, "etcd_ca_file")
            try:
                probe.load_verify_locations(cadata=ca.decode("ascii"))
            except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
                raise ConfigError(f"etcd_ca_file {ca_file}: not PEM certificates ({exc})") from None
        if cert_file is not None and key_file is not None:
            cert = read_credential_file(cert_file, "etcd_cert_file")
            key = read_credential_file(key_file, "etcd_key_file", private=True)
            try:
                probe.load_cert_chain(str(cert_file), str(key_file), password=_no_passphrase)
            except ssl.SSLError as exc:
                raise ConfigError(f"etcd_cert_file {cert_file} and etcd_key_file {key_file}: not a PEM certificate "
                                  f"and its private key ({exc.reason or exc})") from None
            except OSError as exc:
                raise ConfigError(f"etcd_cert_file {cert_file}: cannot read: {exc.strerror or exc}") from None
        password = None
        if user is not None and password_file is not None:
            raw = read_credential_file(password_file, "etcd_password_file", limit=4096, private=True)
            try:
                password = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise ConfigError(f"etcd_password_file {password_file}: not UTF-8 text") from None
        sec = cls(tls=ca is not None or cert is not None, ca=ca, cert=cert, key=key, user=user, password=password)
        return sec.for_endpoints(",".join(getattr(config, "etcd", None) or ()))

    def for_endpoints(self, endpoints: str) -> "EtcdSecurity":
        """These settings for ``endpoints``: TLS on where they say ``https://``. ConfigError when
        they mix schemes, or say ``http://`` while TLS files are given."""
        schemes = {part.split("://", 1)[0].strip().lower() for part in endpoints.split(",") if "://" in part}
        if not schemes <= {"http", "https"}:
            raise ConfigError(f"etcd endpoints take http:// or https://, not {', '.join(sorted(schemes))}")
        if len(schemes) > 1:
            raise ConfigError("etcd endpoints mix http:// and https://: one etcd cluster speaks one of them")
        if schemes == {"http"} and self.tls:
            raise ConfigError("etcd endpoints say http:// but etcd_ca_file or etcd_cert_file is set (TLS): "
                              "use https:// or host:port")
        return replace(self, tls=True) if schemes == {"https"} and not self.tls else self


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix``."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[:i + 1])
    return b"\0"


# -- transaction operations (etcd's RequestOp) ------------------------------------------------------
def op_range(key: bytes, range_end: bytes = b"", keys_only: bool = False) -> Any:
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key, range_end=range_end, keys_only=keys_only))


def op_put(key: bytes, value: bytes = b"", lease: int = 0) -> Any:
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=value, lease=lease))


def op_delete(key: bytes, range_end: bytes = b"") -> Any:
    return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key, range_end=range_end))


def _results(resp: Any) -> list[list[Any] | None]:
    """One entry per operation of a TxnResponse: the KeyValues of a range, None for the others."""
    return [list(r.response_range.kvs) if r.WhichOneof("response") == "response_range" else None
            for r in resp.responses]


class EtcdClient:
    """One gRPC channel to one etcd endpoint ``host:port`` (the directory rotates over members)."""

    def __init__(self, endpoint: str, timeout_s: float = 2.0, security: EtcdSecurity | None = None) -> None:
        if _IMPORT_ERROR is not None:
            raise ConfigError(f"cluster mode needs the 'python3-etcd3' package: {_IMPORT_ERROR}")
        self.security = sec = (security or EtcdSecurity()).for_endpoints(endpoint)
        endpoint = endpoint.split("://", 1)[-1]
        host, _, port = endpoint.rpartition(":")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        if sec.tls:
            creds = grpc.ssl_channel_credentials(sec.ca, sec.key, sec.cert)
            ep = Endpoint(host, int(port), secure=True, creds=creds, time_retry=0, opts=GRPC_OPTIONS)
        else:
            ep = Endpoint(host, int(port), secure=False, time_retry=0, opts=GRPC_OPTIONS)
        self._channel = ep.channel
        self._watchers: list[Any] = []
        # The library would authenticate here, failing while etcd is down: the first call does it.
        self._etcd = MultiEndpointEtcd3Client(endpoints=[ep], timeout=timeout_s)
        self._auth_lock = threading.Lock()
        self._authenticated = sec.user is None
        self.authentications = 0  # tokens taken (the first, and one after each expiry or etcd restart)

    def on_ready(self, callback: Any) -> None:
        """Call ``callback()`` (on a gRPC thread) whenever the channel becomes connected, and keep
        the channel connecting meanwhile, so that a caller backing off learns at once that etcd is back."""
        def watch(state: Any) -> None:
            if state == grpc.ChannelConnectivity.READY:
                callback()

        self._watchers.append(watch)
        self._channel.subscribe(watch, try_to_connect=True)

    def _error(self, exc: BaseException, authenticating: bool = False) -> EtcdError:
        # The library maps some gRPC codes to its own exceptions without the details; the gRPC
        # error it was raised from keeps them.
        rpc = exc if isinstance(exc, grpc.RpcError) else exc.__context__
        if not (isinstance(rpc, grpc.RpcError) and hasattr(rpc, "code")):
            return EtcdError(f"etcd {self.endpoint}: {type(exc).__name__}: {exc}")
        code, details = rpc.code(), rpc.details() or ""
        sc = grpc.StatusCode
        sec = self.security
        who = f"user {sec.user!r}" if sec.user else (
            "the client certificate's common name" if sec.cert else "this client (no etcd_user, no client certificate)")
        if code == sc.UNAVAILABLE and sec.tls and _TLS_FAILURE.search(details):
            return EtcdAuthError(f"etcd {self.endpoint}: TLS handshake failed ({details}); check etcd_ca_file (the CA "
                                 "of etcd's server certificate), etcd_cert_file and etcd_key_file (a client "
                                 "certificate etcd trusts)", code.name)
        if authenticating and code == sc.INVALID_ARGUMENT:
            return EtcdAuthError(f"etcd {self.endpoint}: authentication of {who} refused: {details} (check etcd_user "
                                 "and etcd_password_file)", code.name)
        if code == sc.INVALID_ARGUMENT and "user name is empty" in details:
            return EtcdAuthError(f"etcd {self.endpoint}: etcd requires authentication ({details}): set etcd_user and "
                                 "etcd_password_file, or a client certificate whose common name is an etcd user",
                                 code.name)
        if code in (sc.UNAUTHENTICATED, sc.PERMISSION_DENIED):
            return EtcdAuthError(f"etcd {self.endpoint}: {code.name} for {who}: {details} (the role needs readwrite "
                                 "on the key prefix tutti/: docs/CLUSTER.md)", code.name)
        hint = ""
        if code == sc.UNAVAILABLE and not sec.tls and "Socket closed" in details:
            hint = " (if etcd serves TLS: an https:// endpoint or etcd_ca_file)"
        return EtcdError(f"etcd {self.endpoint}: {code.name}: {details}{hint}", code.name)

    def _authenticate(self, stale: Any) -> None:
        """Take a token for the user, unless another thread replaced the ``stale`` one meanwhile."""
        with self._auth_lock:
            if self._authenticated and self._etcd.metadata is not stale:
                return
            req = etcdrpc.AuthenticateRequest(name=self.security.user, password=self.security.password)
            try:
                resp = self._etcd.authstub.Authenticate(req, self.timeout_s)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in (exc.details() or ""):
                    log.warning("etcd %s has authentication off: etcd_user %r is not used, and any client that "
                                "reaches etcd may write the directory (docs/CLUSTER.md)", self.endpoint,
                                self.security.user)
                    self._etcd.metadata = None
                    self._authenticated = True
                    return
                raise self._error(exc, authenticating=True) from None
            self._etcd.metadata = (("token", resp.token),)
            self._authenticated = True
            self.authentications += 1

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        for attempt in range(2):
            token = self._etcd.metadata
            try:
                if not self._authenticated:
                    self._authenticate(token)
                return fn(*args, **kwargs)
            except (grpc.RpcError, etcd3_exceptions.Etcd3Exception, ValueError) as exc:
                err = self._error(exc)
            if attempt == 0 and self.security.user and err.code == "UNAUTHENTICATED":
                # The token expired, or etcd restarted and forgot it: authenticate again, once.
                self._authenticated = False
                continue
            raise err
        raise AssertionError("unreachable")

    def txn(self, ops: Sequence[Any]) -> list[list[Any] | None]:
        """Run the RequestOps unconditionally in one transaction; one entry per op (kvs for ranges)."""
        return self.txn_many([ops])[0]

    def txn_many(self, batches: Sequence[Sequence[Any]]) -> list[list[list[Any] | None]]:
        """Several transactions sent at once (about one round trip of wall time); raises on any failure."""
        def run() -> list[list[list[Any] | None]]:
            stub, md = self._etcd.kvstub, self._etcd.metadata  # md: the user's token, if any
            futures = [stub.Txn.future(etcdrpc.TxnRequest(success=ops), timeout=self.timeout_s, metadata=md)
                       for ops in batches]
            return [_results(f.result()) for f in futures]

        return self._guard(run)  # type: ignore[no-any-return]

    def get_prefix(self, prefix: bytes) -> list[Any]:
        return list(self._guard(self._etcd.get_prefix_response, prefix).kvs)

    def count_prefix(self, prefix: bytes) -> int:
        return int(self._guard(self._etcd.get_prefix_response, prefix, count_only=True).count)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self._guard(self._etcd.put, key, value, lease=lease)

    def lease_grant(self, ttl_s: int) -> int:
        lease = self._guard(self._etcd.lease, ttl_s)
        if not lease.id:
            raise EtcdError(f"etcd {self.endpoint}: lease grant returned no id")
        return int(lease.id)

    def lease_keepalive(self, lease_id: int) -> int:
        """Refresh a lease once; returns the remaining TTL (0: the server does not know the lease)."""
        def run() -> int:
            for resp in self._etcd.refresh_lease(lease_id):
                return int(resp.TTL)
            return 0

        return self._guard(run)  # type: ignore[no-any-return]

    def lease_revoke(self, lease_id: int) -> None:
        self._guard(self._etcd.revoke_lease, lease_id)

    def close(self) -> None:
        for watch in self._watchers:
            self._channel.unsubscribe(watch)
        self._watchers.clear()
        self._etcd.close()

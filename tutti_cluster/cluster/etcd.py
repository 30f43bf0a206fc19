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
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from tutti_cluster.errors import ConfigError, TuttiError

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

__all__ = ["EtcdClient", "EtcdError", "GRPC_OPTIONS", "KeyValue", "op_delete", "op_put", "op_range", "prefix_end"]


class EtcdError(TuttiError):
    """etcd did not answer, or answered with an error (``code``: the gRPC status name)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code

    @property
    def too_many_ops(self) -> bool:
        """etcd refused a transaction above its ``--max-txn-ops``."""
        return "too many operations" in str(self)


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

    def __init__(self, endpoint: str, timeout_s: float = 2.0) -> None:
        if _IMPORT_ERROR is not None:
            raise ConfigError(f"cluster mode needs the 'python3-etcd3' package: {_IMPORT_ERROR}")
        host, _, port = endpoint.rpartition(":")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        ep = Endpoint(host, int(port), secure=False, time_retry=0, opts=GRPC_OPTIONS)
        self._channel = ep.channel
        self._watchers: list[Any] = []
        self._etcd = MultiEndpointEtcd3Client(endpoints=[ep], timeout=timeout_s)

    def on_ready(self, callback: Any) -> None:
        """Call ``callback()`` (on a gRPC thread) whenever the channel becomes connected, and keep
        the channel connecting meanwhile, so that a caller backing off learns at once that etcd is back."""
        def watch(state: Any) -> None:
            if state == grpc.ChannelConnectivity.READY:
                callback()

        self._watchers.append(watch)
        self._channel.subscribe(watch, try_to_connect=True)

    def _error(self, exc: BaseException) -> EtcdError:
        # The library maps some gRPC codes to its own exceptions without the details; the gRPC
        # error it was raised from keeps them.
        rpc = exc if isinstance(exc, grpc.RpcError) else exc.__context__
        if isinstance(rpc, grpc.RpcError) and hasattr(rpc, "code"):
            code = rpc.code()
            return EtcdError(f"etcd {self.endpoint}: {code.name}: {rpc.details()}", code.name)
        return EtcdError(f"etcd {self.endpoint}: {type(exc).__name__}: {exc}")

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (grpc.RpcError, etcd3_exceptions.Etcd3Exception, ValueError) as exc:
            raise self._error(exc) from None

    def txn(self, ops: Sequence[Any]) -> list[list[Any] | None]:
        """Run the RequestOps unconditionally in one transaction; one entry per op (kvs for ranges)."""
        return self.txn_many([ops])[0]

    def txn_many(self, batches: Sequence[Sequence[Any]]) -> list[list[list[Any] | None]]:
        """Several transactions sent at once (about one round trip of wall time); raises on any failure."""
        def run() -> list[list[list[Any] | None]]:
            stub = self._etcd.kvstub
            futures = [stub.Txn.future(etcdrpc.TxnRequest(success=ops), timeout=self.timeout_s) for ops in batches]
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

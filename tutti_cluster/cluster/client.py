"""Engine side of cluster mode: local-first lookup and remote fetch into the engine's KV blocks.

:class:`ClusterClient` wraps an engine's :class:`~tutti_cluster.TuttiStore`:

- ``lookup(keys)``: the local store first; for the keys after the local hit prefix, one etcd
  transaction (:meth:`EtcdDirectory.lookup`) gives the owners of the remote hit prefix.
- ``retrieve_remote(keys, block_ids)``: for each run of keys held by one owner, a stage stream
  (:class:`~tutti_cluster.cluster.stage_stream.StageStream`) has the owner read the units from its SSD into
  its registered arena, our Transfer Engine pulls each into our registered arena, and
  ``store.scatter_unit_async`` places it into the KV blocks, checksums and its key verified on
  the same pass (on a GPU store by a kernel reading the arena, which is registered with the store,
  in place, ordered on the engine's stream); each unit is judged (``store.scatter_wait``) while
  the next ones are pulled, and its slot held until then. With ``keep_replica`` the unit is also
  committed locally (``store.import_unit``). A unit that fails verification is reported to its
  owner, which drops it; a failure of our own (the device) is not.

Counters (``stats``: remote lookups and hits, units and bytes fetched, fetches that ended early)
reach the node daemon's stats, and so the admin plane's ``/metrics``, when the client is given the
engine's ``DaemonLink`` (``link=``).

Nothing here raises for a cluster fault (etcd down, owner dead, transfer failure): lookups then
report fewer hits and retrieve_remote places fewer units, and the engine recomputes the rest.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import OrderedDict, deque
from typing import Any, Sequence

from tutti_cluster.cluster.auth import ClusterSecret, cluster_secret
from tutti_cluster.cluster.directory import EtcdDirectory, advertised_host, local_address_towards
from tutti_cluster.cluster.etcd import EtcdSecurity
from tutti_cluster.errors import ConfigError, LayoutError, NotFound, TuttiError
from tutti_cluster.store import SKIP_BLOCK

log = logging.getLogger(__name__)

SCATTERS_IN_FLIGHT = 4  # at most the store's scatter slots (Store::scatter_unit_async)


class ClusterClient:
    """Cluster lookups and remote fetches for one engine store (see the module docstring)."""

    def __init__(self, store: Any, config: Any = None, *, directory: EtcdDirectory | None = None,
                 arena_bytes: int = 0, window: int = 4, timeout_s: float = 5.0, host: str | None = None,
                 link: Any = None, secret: ClusterSecret | None = None) -> None:
        """``link``: the engine's :class:`~tutti_cluster.node.link.DaemonLink`, if attached; it then
        reports :attr:`stats` (remote fetches: units, bytes, failures) to the node daemon with the
        store's counters, where ``tutti admin stats`` and the admin plane's ``/metrics`` read them.
        ``secret``: the cluster credential; by default the directory's, else the config's
        ``cluster_secret_file`` (ConfigError when unset)."""
        self.store = store
        self.config = config if config is not None else store.config
        if secret is None:
            secret = directory.secret if directory is not None else cluster_secret(self.config)
        self.secret = secret
        if directory is None:
            if not self.config.etcd:
                raise ConfigError("ClusterClient needs etcd endpoints (TUTTI_ETCD)")
            node_id = self.config.node_id or socket.gethostname()
            directory = EtcdDirectory(",".join(self.config.etcd), node_id, self.config.lease_ttl_s,
                                      security=EtcdSecurity.from_config(self.config), secret=secret)
        self.directory = directory
        self.window = window
        self.timeout_s = timeout_s
        self.host = host or (advertised_host(self.config) if getattr(self.config, "advertise_host", None) else
                             local_address_towards(",".join(f"{h}:{p}" for h, p in directory.endpoints)))
        self.arena_bytes = arena_bytes
        self._transfer: Any = None
        self._arena_addr: int | None = None  # the arena as registered with the store (register_host)
        self._owners: OrderedDict[int, list[str]] = OrderedDict()  # from the last lookups
        self.stats: dict[str, float] = {"remote_lookups": 0, "remote_hits": 0, "remote_units": 0,
                                        "remote_bytes": 0, "remote_failures": 0, "replicas_kept": 0,
                                        "pull_s": 0.0, "scatter_s": 0.0}
        if link is not None:
            link.cluster_stats = lambda: dict(self.stats)

    @property
    def transfer(self) -> Any:
        """Our Transfer Engine, started on the first remote fetch."""
        if self._transfer is None:
            from tutti_cluster.cluster.stage_stream import default_depth
            from tutti_cluster.cluster.transfer import TransferNode

            slot = int(self.store.geometry()["slot_bytes"]) if callable(getattr(self.store, "geometry", None)) else 0
            arena = self.arena_bytes or max(default_depth() * slot, 64 << 20)
            self._transfer = TransferNode(self.host, self.config.protocol, arena, slot_bytes=slot,
                                          ports=getattr(self.config, "transfer_ports", None))
            # A GPU store then scatters each unit straight from the arena (mapped), with no copy.
            if callable(getattr(self.store, "register_host", None)):
                try:
                    self._arena_addr = self.store.register_host(
                        self._transfer.view(self._transfer.base, self._transfer.arena_bytes))
                except TuttiError as exc:
                    log.warning("staging arena not mapped for the device (%s): units are copied first", exc)
        return self._transfer

    def lookup(self, keys: Sequence[Any]) -> int:
        """Leading units available: the local hit prefix, extended by the cluster directory."""
        from tutti_cluster.keys import to_key

        ks = [to_key(k) for k in keys]
        n = self.store.lookup(ks)
        if n == len(ks):
            return n
        self.stats["remote_lookups"] += 1
        # Other instances on this node count too: their units come through our own daemon.
        owners = self.directory.lookup(ks[n:], prefix=True, exclude_self=False)
        for k, o in zip(ks[n:], owners):
            self._owners[k] = o
            self._owners.move_to_end(k)
        while len(self._owners) > 1 << 16:
            self._owners.popitem(last=False)
        self.stats["remote_hits"] += len(owners)
        return n + len(owners)

    def retrieve_remote(self, keys: Sequence[Any], block_ids: Sequence[int], keep_replica: bool = False,
                        owners: Sequence[Sequence[str]] | None = None) -> int:
        """Fetch units held by other nodes into ``block_ids`` (``unit_blocks`` ids per key, in order).

        ``owners`` (one list of node ids per key, as a lookup returned them, e.g. the daemon's
        ``lookup`` answer passed from vLLM's scheduler to its worker) saves the directory round trip
        when the lookup ran in another process. Returns how many leading units were placed; the
        caller recomputes the others.
        """
        from tutti_cluster.cluster.stage_stream import StageStream
        from tutti_cluster.keys import to_key

        ks = [to_key(k) for k in keys]
        ub = int(self.store.unit_blocks)
        if len(block_ids) != len(ks) * ub:
            raise ConfigError(f"{len(block_ids)} block ids for {len(ks)} units of {ub} blocks")
        written = [int(b) for b in block_ids if int(b) != SKIP_BLOCK]  # checked and not written
        if len(set(written)) != len(written):  # units scatter concurrently: one block written twice could tear
            raise LayoutError("a block id appears twice: each block is written once")
        if owners is not None:
            for k, o in zip(ks, owners):
                self._owners[k] = list(o)
        missing = [k for k in ks if k not in self._owners]
        if missing:
            found = self.directory.lookup(missing, prefix=False, exclude_self=False)
            for k, o in zip(missing, found):
                self._owners[k] = o
        placed = 0
        while placed < len(ks):
            owners = self._owners.get(ks[placed]) or []
            if not owners:
                break
            owner = owners[0]
            run = placed
            while run < len(ks) and owner in (self._owners.get(ks[run]) or []):
                run += 1
            rec = self.directory.node(owner)
            if rec is None or not rec.stage:
                self._forget(owner)
                continue  # try another replica of the same unit, if any
            try:
                transfer = self.transfer
            except TuttiError as exc:
                log.warning("remote fetch unavailable: %s", exc)
                self.stats["remote_failures"] += 1
                break
            stream = StageStream(transfer, rec.stage, rec.segment, ks[placed:run], self.window, self.timeout_s,
                                 hold=True, secret=self.secret)
            local_error: TuttiError | None = None
            # Scatters run asynchronously, ordered on the engine's stream (a GPU store), while the
            # next units are pulled: (index, key, ticket, done) of each not yet judged, in order.
            pending: deque[tuple[int, int, int, Any]] = deque()
            keep = max(1, min(stream.depth - 1, SCATTERS_IN_FLIGHT))
            received = 0
            failed_at: int | None = None  # the first unit (in this stream) that failed

            def fail(idx: int, key: int, exc: TuttiError) -> None:
                nonlocal failed_at, local_error
                if failed_at is not None and idx >= failed_at:
                    return  # after the first failure: not placed in any case
                failed_at = idx
                if isinstance(exc, NotFound):  # failed verification: a miss, never wrong data
                    log.warning("remote unit %x from %s rejected: %s", key, owner, exc)
                    stream.report_corrupt(key)
                    stream.error = str(exc)
                    local_error = None
                else:  # our own failure (the device, the local store): the owner's unit may be healthy
                    log.warning("placing remote unit %x failed here: %s", key, exc)
                    local_error = exc

            def judge() -> None:
                # The oldest scatter's verdict; only then does its slot go back.
                idx, key, ticket, done = pending.popleft()
                t0 = time.perf_counter()
                try:
                    self.store.scatter_wait(ticket)
                except TuttiError as exc:
                    fail(idx, key, exc)
                finally:
                    done()
                    self.stats["scatter_s"] += time.perf_counter() - t0

            units = iter(stream)
            try:
                for key, view, done in units:
                    idx, received = received, received + 1
                    i = placed + idx
                    try:
                        # key: an owner that hands over another unit's bytes is a miss, as a corrupt unit is
                        ticket = self.store.scatter_unit_async(view, block_ids[i * ub:(i + 1) * ub], key=key)
                    except TuttiError as exc:  # refused before it started (a header that fails, another key)
                        done()
                        fail(idx, key, exc)
                        break
                    pending.append((idx, key, ticket, done))  # its slot is held until judged
                    if keep_replica:
                        try:
                            self.store.import_unit(view)
                            self.stats["replicas_kept"] += 1
                        except TuttiError as exc:
                            fail(idx, key, exc)
                    while pending and (failed_at is not None or len(pending) >= keep):
                        judge()
                    if failed_at is not None:
                        break
            finally:
                while pending:  # every scatter is waited for before its slot goes back
                    judge()
                units.close()  # type: ignore[attr-defined]  # ends the puller, returns its slots
            got = received if failed_at is None else failed_at
            self.stats["remote_units"] += got
            self.stats["remote_bytes"] += stream.bytes
            self.stats["pull_s"] += stream.pull_s
            placed += got
            if local_error is not None:
                self.stats["remote_failures"] += 1
                break
            if placed < run:
                self.stats["remote_failures"] += 1
                log.info("remote fetch from %s stopped after %d of %d units: %s", owner, got, run - (placed - got),
                         stream.error or stream.miss)
                self._forget(owner, ks[placed:run])
                if stream.error:
                    self.directory.forget_node(owner)
                if not (self._owners.get(ks[placed]) or []):
                    break
        return placed

    def _forget(self, owner: str, keys: Sequence[int] | None = None) -> None:
        """Stop using ``owner`` for ``keys`` (all cached keys when None)."""
        for k in (keys if keys is not None else list(self._owners)):
            o = self._owners.get(k)
            if o and owner in o:
                o.remove(owner)

    def close(self) -> None:
        if self._arena_addr is not None:
            self.store.unregister_host(self._arena_addr)
            self._arena_addr = None
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None

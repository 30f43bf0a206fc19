"""The node daemon's read-only view of one engine instance's pools."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Iterator, cast

from tutti_cluster.config import TuttiConfig
from tutti_cluster.errors import NotFound, TuttiError
from tutti_cluster.node.protocol import UnitTier

log = logging.getLogger(__name__)


class PoolView:
    """The daemon's read-only view of one engine instance's pools.

    One read-only store per instance, opened once. Units the engine commits later are picked up
    with ``store.refresh()`` (a rescan of the pool headers); ``refreshed_at`` is when the last
    rescan began (it finds every unit committed before then). Reads share the view and run in
    parallel (the stage endpoint reads from several threads; the store's reads release the GIL); a
    refresh, reopen or close holds it alone, since a refresh rebuilds the store's index in place.
    """

    def __init__(self, config: TuttiConfig, name: str, geometry: dict[str, Any], capacity: list[int],
                 memory_capacity: list[int] | None = None) -> None:
        self.name = name
        self.geometry = geometry
        self.capacity = capacity
        # The instance's share of the memory tier: with one, the view opens the instance's pools on
        # the node's memory paths too, and its index holds the units found in either tier.
        self.memory_capacity = list(memory_capacity or [])
        self.config = config.model_copy(update={"instance": name, "unit_tokens": geometry["unit_tokens"],
                                                "memory_paths": config.memory_paths if self.memory_capacity else []})
        self.store: Any = None
        self._opened_geometry: dict[str, Any] | None = None
        self._opened_memory: list[int] = []  # the memory share the open store was opened with
        self.refreshed_at = 0.0
        self.committed_at = 0.0  # when the daemon last heard of a commit of this instance (monotonic)
        self._cv = threading.Condition()
        self._readers = 0
        self._exclusive = False

    @contextlib.contextmanager
    def _shared(self) -> Iterator[Any]:
        with self._cv:
            self._cv.wait_for(lambda: not self._exclusive)
            self._readers += 1
        try:
            yield self.store
        finally:
            with self._cv:
                self._readers -= 1
                if not self._readers:
                    self._cv.notify_all()

    @contextlib.contextmanager
    def _alone(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: not self._exclusive)
            self._exclusive = True  # new readers wait from here on
            self._cv.wait_for(lambda: not self._readers)
        try:
            yield
        finally:
            with self._cv:
                self._exclusive = False
                self._cv.notify_all()

    def open(self) -> list[int]:
        """Open the pools read-only (or rescan their headers when open) and return the keys they hold."""
        with self._alone():
            began = time.monotonic()
            g = self.geometry
            if self.store is not None and g == self._opened_geometry and self._opened_memory == self.memory_capacity:
                self.store.refresh()
            else:
                # First open, the engine came back with another geometry, or the memory tier the
                # last open did not find.
                if self.store is not None:
                    self.store.close()
                    self.store = None
                try:
                    st, memory = self._open_store(self.config), self.memory_capacity
                except NotFound as exc:
                    if not self.memory_capacity:
                        raise
                    # The memory tier's files are gone (tmpfs after a reboot) while the storage
                    # copies are not: serve those until the engine comes back and makes the tier again.
                    st, memory = self._open_store(self.config.model_copy(update={"memory_paths": []})), []
                    log.info("instance %s: its memory tier is not there (%s); the storage tier alone is served "
                             "until the engine attaches again", self.name, exc)
                self.store, self._opened_geometry, self._opened_memory = st, dict(g), memory
            self.refreshed_at = began
            return list(self.store.keys())

    def _open_store(self, config: TuttiConfig) -> Any:
        from tutti_cluster.store import TuttiStore

        g = self.geometry
        st = TuttiStore(config)
        st.open_pools(num_layers=g["num_layers"], objs_per_layer=g["nptr"], block_bytes=g["block_bytes"],
                      block_tokens=g["block_tokens"], dtype=g.get("dtype", ""), block_shape=tuple(g.get("block_shape", ())))
        return st

    def _refresh(self, seen: float) -> bool:
        """Rescan the headers unless a rescan began after ``seen``; False when it failed."""
        with self._alone():
            if self.store is None:
                return False
            if self.refreshed_at > seen:
                return True
            began = time.monotonic()
            try:
                self.store.refresh()
            except TuttiError as exc:
                log.warning("cannot rescan instance %s: %s", self.name, exc)
                return False
            finally:
                self.refreshed_at = began
            return True

    def read_into(self, key: int, view: memoryview, refresh_after_s: float = 0.2, verify: bool = False) -> int | None:
        """Read the unit of ``key`` straight into ``view``: its size, or None if absent.

        ``store.read_unit_into`` lands in place with O_DIRECT when ``view`` is 4 KiB aligned (the
        registered staging slots are), so a staged unit is never copied on this node. Unless
        ``verify``, only its header is checked here (key and layout): the requester verifies every
        object's checksum as it scatters, so a corrupt object is its miss (it reports it, and
        ``NodeDaemon`` then verifies its copy), and each byte is summed once. A key committed
        after our last rescan triggers one ``refresh()`` (at most every ``refresh_after_s``): within
        that limit the read waits for the next rescan when a commit was heard since the last one
        began (``committed_at``: the daemon lists the key because it heard its commit, so that
        rescan finds it), and is a miss otherwise. Raises NotFound when the slot holds another
        unit (evicted and overwritten under us), CapacityExceeded when ``view`` is too small.
        """
        for attempt in range(2):
            with self._shared() as st:
                seen = self.refreshed_at
                if st is not None and st.contains(key):
                    return int(st.read_unit_into(key, view, verify=verify))
            if attempt or st is None:
                return None
            heard = self.committed_at
            wait = seen + refresh_after_s - time.monotonic()
            if wait > 0:
                if heard < seen:
                    return None  # nothing committed since the last rescan began: a rescan would not find it
                time.sleep(wait)
            if not self._refresh(max(seen, heard)):
                return None
        return None

    def holds(self, key: int, since: float) -> bool:
        """Whether the pool headers hold ``key``, as of a rescan no older than ``since`` (monotonic)."""
        if self.refreshed_at < since and not self._refresh(since):
            return True  # cannot tell: the rescan failed (logged), so do not drop the unit
        with self._shared() as st:
            return st is not None and bool(st.contains(key))

    def unit_tiers(self, keys: list[int]) -> list[UnitTier]:
        """Where each of ``keys`` lay at the last rescan ("memory", "storage", "both"; "" absent)."""
        with self._shared() as st:
            return cast(list[UnitTier], list(st.unit_tiers(keys))) if st is not None else [""] * len(keys)

    def slot_bytes(self) -> int:
        with self._shared() as st:
            return int(st.geometry()["slot_bytes"]) if st is not None else 0

    def stats(self) -> dict[str, Any]:
        """The read-only store's counters (units and slots as the pool headers show them)."""
        with self._shared() as st:
            return dict(st.stats()) if st is not None else {}

    def close(self) -> None:
        with self._alone():
            st, self.store = self.store, None
        if st is not None:
            st.close()


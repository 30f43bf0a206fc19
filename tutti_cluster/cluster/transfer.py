"""The Mooncake Transfer Engine and a registered staging arena.

One :class:`TransferNode` per process that moves cache units between nodes: the owner's daemon
stages units in its arena and the requester pulls them into its own arena with
an asynchronous Transfer Engine read (one-sided: the owner's process does nothing during the pull
but serve it from the Transfer Engine's own threads), waited for with short sleeps (:meth:`read`).

The Transfer Engine runs with Mooncake's P2P handshake metadata (``P2PHANDSHAKE``): its segment is
named ``host:rpc_port`` and peers exchange segment descriptors directly. The segment name is
published in the node's etcd record, so the data path needs no metadata server and survives etcd
outages and etcd data loss (see docs/CLUSTER.md for the measurement behind this choice).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from tutti_cluster.errors import ConfigError, DeviceError, TuttiError

log = logging.getLogger(__name__)

SLOT_ALIGN = 4096  # O_DIRECT alignment of the store's reads (and a page for RDMA registration)

# Larger TCP slices move more per syscall: measured ~0.8-1.0 GiB/s loopback on a 2-core host with
# 1 MiB slices. Set before the engine starts (Mooncake reads it at initialisation).
os.environ.setdefault("MC_TCP_SLICE_SIZE", str(1 << 20))
# A peer that stops answering mid-transfer (frozen, partitioned) fails the transfer after this many
# seconds. Mooncake's default of 30 s would stall a request that long; a 32 MiB unit takes well
# under a second even on a slow link. Measured here: a frozen owner failed the read after 30 s by
# default and after 5 s with this setting (Mooncake checks at about that granularity).
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
_TRANSFER_TIMEOUT_S = float(os.environ["MC_TRANSFER_TIMEOUT"])
# Completion checks of a pull: one sleep through most of the time the last pulls' rate predicts,
# then checks every _POLL_S (a 32 MiB unit takes 10-40 ms, so a check adds well under 1 %).
_POLL_S = 0.0002
_PREDICTED_SHARE = 0.8
_BAD_BATCH = (1 << 64) - 1  # Mooncake's batch id type is unsigned: its -1 arrives as this


def _import_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except Exception as exc:  # ImportError, or OSError when libibverbs1 is missing
        raise ConfigError(
            "cluster mode needs PyPI 'mooncake-transfer-engine-non-cuda' (and Debian 'libibverbs1'): "
            f"{exc}") from exc
    return TransferEngine


def _mlock(addr: int, length: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(length)) == 0:
            return True
        log.debug("mlock of the staging arena refused: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        log.debug("mlock unavailable: %s", exc)
    return False


@dataclass
class Pull:
    """One submitted pull (:meth:`TransferNode.start_read`)."""

    batch: int
    segment: str
    local_addr: int
    length: int
    t0: float
    deadline: float
    seconds: float = 0.0  # submit to completion, once waited for


class TransferNode:
    """A Transfer Engine plus an anonymous, populated (page-locked when allowed) arena registered with
    it, cut into slots.

    Slots all have ``slot_bytes`` bytes (one cache unit: all units of one model have one size).
    ``acquire()`` blocks until a slot is free or the timeout passes; ``release()`` returns it.
    """

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", arena_bytes: int = 256 << 20,
                 slot_bytes: int = 0, device_name: str = "", ports: str | None = None) -> None:
        """``ports``: ``"LOW-HIGH"``, the range the engine takes its handshake and TCP data ports from
        (Mooncake reads it from ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` when it starts)."""
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if arena_bytes <= 0:
            raise ConfigError("arena_bytes must be positive")
        if ports:
            # Mooncake reads the range once, when its module loads.
            low, _, high = ports.partition("-")
            loaded = (os.environ.get("MC_MIN_RPC_PORT"), os.environ.get("MC_MAX_RPC_PORT"))
            if "mooncake.engine" in sys.modules and loaded != (low, high):
                log.warning("Transfer Engine ports %s not applied: its module was loaded with another range", ports)
            os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"] = low, high
        engine_cls = _import_engine()
        self.engine = engine_cls()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            where = f" (ports {ports}: two of them must be free)" if ports else ""
            raise DeviceError(f"Mooncake Transfer Engine failed to start ({protocol} on {hostname}){where}: code {rc}")
        self.hostname = hostname
        self.protocol = protocol
        self.segment = f"{hostname}:{self.engine.get_rpc_port()}"
        page = mmap.PAGESIZE
        self.arena_bytes = (arena_bytes + page - 1) // page * page
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._arena = mmap.mmap(-1, self.arena_bytes, flags=flags)
        self._arena_c = (ctypes.c_char * self.arena_bytes).from_buffer(self._arena)
        self.base = ctypes.addressof(self._arena_c)
        # Page-lock the arena (pinned host memory, as RDMA and GPU copies want); best effort, since
        # RLIMIT_MEMLOCK may forbid it, and TCP works either way. RDMA registration pins it anyway.
        self.pinned = _mlock(self.base, self.arena_bytes)
        rc = self.engine.register_memory(self.base, self.arena_bytes)
        if rc != 0:
            raise DeviceError(f"registering {self.arena_bytes} bytes with the Transfer Engine failed: code {rc}")
        self._cv = threading.Condition()
        self._seconds_per_byte = 0.0  # recent pulls, for the first sleep of the next one
        self.slot_bytes = 0
        self._free: list[int] = []
        self._retired: set[int] = set()
        self._nslots = 0
        if slot_bytes:
            self.configure(slot_bytes)
        log.info("transfer engine %s (%s), arena %d MiB", self.segment, protocol, self.arena_bytes >> 20)

    # -- slots ------------------------------------------------------------------------------------
    def configure(self, slot_bytes: int) -> None:
        """Cut the arena into slots of ``slot_bytes`` (only while no slot is out)."""
        with self._cv:
            if slot_bytes == self.slot_bytes:
                return
            if len(self._free) + len(self._retired) != self._nslots:
                raise TuttiError("cannot change the slot size while slots are in use")
            if self._retired:
                raise TuttiError("cannot change the slot size: a transfer may still write into a retired slot")
            # Slots start on 4 KiB boundaries, so that the store reads into them with O_DIRECT.
            stride = (slot_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
            n = self.arena_bytes // stride
            if n < 1:
                raise ConfigError(f"arena of {self.arena_bytes} bytes cannot hold a {slot_bytes}-byte unit")
            self.slot_bytes = slot_bytes
            self._nslots = n
            self._free = [self.base + i * stride for i in range(n - 1, -1, -1)]

    @property
    def num_slots(self) -> int:
        return self._nslots

    def slot_addresses(self) -> list[int]:
        """Every slot's address, in arena order (free or not)."""
        stride = (self.slot_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
        return [self.base + i * stride for i in range(self._nslots)]

    def acquire(self, timeout: float | None = None) -> int | None:
        """Address of a free slot, or None after ``timeout`` seconds."""
        with self._cv:
            if not self._cv.wait_for(lambda: bool(self._free), timeout):
                return None
            return self._free.pop()

    def release(self, addr: int) -> None:
        with self._cv:
            if addr in self._retired:
                return
            self._free.append(addr)
            self._cv.notify()

    def view(self, addr: int, length: int) -> memoryview:
        """A writable view of ``length`` bytes of the arena at ``addr``."""
        off = addr - self.base
        if off < 0 or off + length > self.arena_bytes:
            raise TuttiError("address outside the staging arena")
        return memoryview(self._arena)[off:off + length]

    def put(self, addr: int, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` into the arena at ``addr`` (a C memmove, which releases the GIL)."""
        n = len(data)
        if addr - self.base + n > self.arena_bytes:
            raise TuttiError("data does not fit the staging arena")
        if isinstance(data, bytes):
            ctypes.memmove(addr, data, n)
        else:
            self.view(addr, n)[:] = data

    # -- transfers --------------------------------------------------------------------------------
    def read(self, segment: str, local_addr: int, remote_addr: int, length: int) -> None:
        """Pull ``length`` bytes from ``remote_addr`` in ``segment`` into our arena; raise on failure."""
        self.wait(self.start_read(segment, local_addr, remote_addr, length))

    def start_read(self, segment: str, local_addr: int, remote_addr: int, length: int) -> Pull:
        """Submit a pull (asynchronous); :meth:`wait` for it before the slot is used or released."""
        t0 = time.monotonic()
        batch = self.engine.batch_transfer_async_read(segment, [local_addr], [remote_addr], [length])
        if batch in (0, -1, _BAD_BATCH):  # the segment cannot be opened, or the submit failed
            raise TuttiError(f"transfer from {segment} could not be started")
        # As Mooncake's own deadline: its transfer timeout plus 1 s per GiB.
        return Pull(batch, segment, local_addr, length, t0, t0 + _TRANSFER_TIMEOUT_S + length / (1 << 30))

    def wait(self, pull: Pull) -> None:
        """Wait for ``pull``; raise if it failed.

        Waits with sleeps: one through most of the time the recent pulls' rate predicts, then short
        ones. Mooncake's own ``transfer_sync_read`` polls the transfer status in a tight loop,
        which keeps one core busy for the whole pull; on a host with few cores that core is taken
        from the Transfer Engine's TCP threads, the owner's reads and our scatter. A transfer that
        neither completes nor fails by the deadline retires its local slot (a late completion could
        still write into it) and raises.
        """
        if self._seconds_per_byte:
            ahead = _PREDICTED_SHARE * self._seconds_per_byte * pull.length - (time.monotonic() - pull.t0)
            if ahead > 0:
                time.sleep(min(1.0, ahead))
        while True:
            rc = self.engine.transfer_check_status(pull.batch)
            if rc == 1:
                pull.seconds = time.monotonic() - pull.t0
                rate = pull.seconds / max(1, pull.length)
                self._seconds_per_byte = rate if not self._seconds_per_byte else 0.5 * (self._seconds_per_byte + rate)
                return
            if rc == -1:
                raise TuttiError(f"transfer from {pull.segment} failed")
            if rc == -2 or time.monotonic() > pull.deadline:
                self.retire(pull.local_addr)
                raise TuttiError(f"transfer from {pull.segment} timed out")
            time.sleep(_POLL_S)

    def read_sync(self, segment: str, local_addr: int, remote_addr: int, length: int) -> None:
        """The same pull through Mooncake's ``transfer_sync_read`` (the benchmark's reference)."""
        rc = self.engine.transfer_sync_read(segment, local_addr, remote_addr, length)
        if rc != 0:
            raise TuttiError(f"transfer from {segment} failed: code {rc}")

    def retire(self, addr: int) -> None:
        """Never hand out the slot at ``addr`` again (a transfer into it may still be in flight)."""
        with self._cv:
            self._retired.add(addr)
            if addr in self._free:
                self._free.remove(addr)
        log.warning("staging slot %#x retired after a transfer that did not finish", addr)

    def close(self) -> None:
        try:
            self.engine.unregister_memory(self.base)
        except Exception:  # the engine may already be shutting down; nothing to recover
            pass

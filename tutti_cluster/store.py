"""`TuttiStore`: the engine-facing store of one GPU (or CPU) process.

Life cycle::

    store = TuttiStore(TuttiConfig(paths=["/mnt/nvme0"]))
    store.register_kv_caches(kv_caches, block_tokens=16)       # opens the pool, rebuilds the index
    hit = store.lookup(keys)                                    # leading units present
    req = store.begin_retrieve(keys[:hit], block_ids)           # once per request: O(blocks)
    for layer in range(num_layers):
        store.retrieve_layer(layer, req)                        # O(1) host work, asynchronous
        store.wait_layer(layer, req)                            # before the layer's attention
    result = store.finish(req)                                  # failed units are misses

Stores mirror it with ``begin_store``/``store_layer``. A unit becomes visible (``lookup``) only after
every one of its objects and then its header are on storage.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import operator
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tutti_cluster import _native
from tutti_cluster.config import TuttiConfig, load_config, native_options
from tutti_cluster.errors import ConfigError, DeviceError, LayoutError, NotFound, TuttiError
from tutti_cluster.files import group_id, make_dir
from tutti_cluster.keys import Key, key_array, to_key
from tutti_cluster.kv_layout import Layout, LayerKV, describe, describe_block, layer_kv_from_tensor

log = logging.getLogger(__name__)

_RETRIEVE, _STORE = _native.ReqOp.RETRIEVE, _native.ReqOp.STORE
# A retrieve's (or scatter's) block id for a block of a unit that is checked with the rest of its
# object but written nowhere: the engine holds it already (a prefix cache hit ending inside the unit).
SKIP_BLOCK = -1


#: unit_tiers' words for the native bits (1: a copy in memory, 2: one on storage).
_TIERS = ("", "memory", "storage", "both")

#: Why a unit of a request failed (:attr:`UnitFailure.cause`), and what each means.
FAILURE_CAUSES: dict[str, str] = {
    "checksum": "checksum mismatch (the bytes on disk are not those written: the unit is dropped)",
    "io_error": "I/O error on the pool file",
    "not_present": "not in the pool (evicted or removed since the lookup)",
    "too_few_blocks": "the unit holds fewer blocks than asked for",
    "no_free_slot": "no free slot in the pool (every slot holds a unit being read, written or pinned)",
    "incomplete_layers": "a layer of the request was not issued or its I/O could not start",
    "device_error": "the device failed before the unit could be vouched for",
    "commit_failed": "the unit's header could not be written",
}


@dataclass(frozen=True)
class UnitFailure:
    """One failed unit of a request: why (a key of :data:`FAILURE_CAUSES`) and where it lay.
    ``pool_file``, ``slot`` (within that file) and ``offset`` (the slot's first byte in it) are
    None for a unit that had no slot (``not_present``, ``too_few_blocks``, ``no_free_slot``)."""

    index: int  # the unit's index in the request
    key: int
    cause: str
    pool_file: str | None = None
    slot: int | None = None
    offset: int | None = None
    errno: int = 0  # io_error: the errno where the backend knows it (0: a short transfer, or unknown)

    @classmethod
    def from_native(cls, f: Any) -> UnitFailure:
        slot = f.slot
        where = slot is not None
        return cls(index=int(f.unit), key=int(f.key), cause=str(f.cause), pool_file=f.pool_file if where else None,
                   slot=slot, offset=int(f.offset) if where else None, errno=int(f.error))

    def describe(self) -> str:
        """``unit 3 (key 00000000000000ab) in /mnt/a/tutti-default.pool slot 7 (byte 917504): checksum mismatch ...``"""
        where = (f" in {self.pool_file} slot {self.slot} (byte {self.offset})" if self.pool_file is not None
                 else " (no slot)")
        why = FAILURE_CAUSES.get(self.cause, self.cause)
        if self.cause == "io_error":
            why += (f": {os.strerror(self.errno)} (errno {self.errno})" if self.errno
                    else ": short transfer or errno unknown")
        return f"unit {self.index} (key {self.key:016x}){where}: {why}"


@dataclass
class RequestResult:
    """Outcome of one request. ``failed_units`` were not moved: treat them (and what follows) as misses;
    ``failures`` says why each failed, and where it lay (one :class:`UnitFailure` per failed unit)."""

    units: int
    failed_units: list[int] = field(default_factory=list)
    failures: list[UnitFailure] = field(default_factory=list)
    skipped_units: int = 0
    committed_units: list[int] = field(default_factory=list)
    #: Layers never issued or whose I/O could not start: then every unit failed (nothing loaded,
    #: nothing committed).
    incomplete_layers: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed_units


def struct_dict(obj: Any) -> dict[str, Any]:
    """A native struct (Geometry, StoreStats, RequestResult) as a dict of its fields."""
    cls = type(obj)
    return {n: getattr(obj, n) for n in dir(cls) if isinstance(getattr(cls, n, None), property)}


def _inner_lists(inner_keys: Any) -> list[list[Any]]:
    """``inner_keys`` as one list per unit; LayoutError for anything else (a bytes key in place of
    a unit's list, say, which would otherwise be read as one key per byte)."""
    text = (bytes, bytearray, memoryview, str)
    try:
        if isinstance(inner_keys, text):
            raise TypeError
        lists = []
        for ks in inner_keys:
            if isinstance(ks, text):
                raise TypeError
            lists.append(list(ks))
    except TypeError:
        raise LayoutError("inner_keys must hold one list of integer keys per unit") from None
    return lists


# What register_kv_caches keeps of each registered tensor, to tell at each request that its memory is
# still where the native core's raw pointers point:
# torch: (layer, tensor, its storage, the tensor's data pointer, bytes its storage must still hold);
# numpy: (layer, the array owning the memory, its data pointer, its byte size, whether the pointer can
# be read through the buffer protocol: a writable C-contiguous array, 4x cheaper than __array_interface__).
_TorchGuard = tuple[int, Any, Any, int, int]
_NumpyGuard = tuple[int, np.ndarray, int, int, bool]
_Guards = tuple[list[_TorchGuard], list[_NumpyGuard]]


def _extent_bytes(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """Bytes from a tensor's first element to the end of its last (non-negative strides)."""
    if any(n == 0 for n in shape):
        return 0
    return (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * itemsize


def _kv_guards(layers: Sequence[LayerKV]) -> tuple[_Guards, list[_Guards]]:
    """The memory guards of the registered layers' owner tensors: every one once, and per layer.

    A torch tensor keeps its storage object, which keeps the memory alive (``t.set_()`` then
    cannot free it), but ``t.resize_()`` and ``t.untyped_storage().resize_()`` reallocate or free
    that memory in place; a numpy array owning its memory moves it in ``resize(refcheck=False)``.
    The guard records where the memory was and how much of it the registration needs."""
    all_torch: list[_TorchGuard] = []
    all_numpy: list[_NumpyGuard] = []
    seen: set[int] = set()
    per_layer: list[_Guards] = []
    for i, l in enumerate(layers):
        owner = l.owner
        tensors = owner if isinstance(owner, (tuple, list)) else (owner,)
        torch_g: list[_TorchGuard] = []
        numpy_g: list[_NumpyGuard] = []
        for t in tensors:
            if isinstance(t, np.ndarray):
                o: Any = t
                while getattr(o, "base", None) is not None:  # views, and as_strided's interface holder
                    o = o.base
                if not isinstance(o, np.ndarray) or not o.flags.owndata:
                    continue  # memory of another object (a buffer, an mmap), held in place by its export
                fast = bool(o.flags.c_contiguous and o.flags.writeable and o.nbytes)
                ng = (i, o, _array_ptr(o, False), int(o.nbytes), fast)
                numpy_g.append(ng)
                if id(o) not in seen:
                    seen.add(id(o))
                    all_numpy.append(ng)
            elif hasattr(t, "untyped_storage") and hasattr(t, "data_ptr"):
                try:
                    storage = t.untyped_storage()
                    ptr = int(t.data_ptr())
                    need = ptr - int(storage.data_ptr()) + _extent_bytes(t.shape, t.stride(), t.element_size())
                except (RuntimeError, NotImplementedError) as e:
                    raise LayoutError(f"cannot hold the memory of the KV cache tensor of layer {i}: {e}") from None
                tg = (i, t, storage, ptr, need)
                torch_g.append(tg)
                if id(t) not in seen:
                    seen.add(id(t))
                    all_torch.append(tg)
            # None (a bare descriptor) or anything else: its memory is the caller's to keep in place
        per_layer.append((torch_g, numpy_g))
    return (all_torch, all_numpy), per_layer


def _check_guards(guards: _Guards) -> None:
    """LayoutError when a registered tensor's memory moved or shrank since registration."""
    torch_g, numpy_g = guards
    for layer, t, storage, ptr, need in torch_g:
        if t.data_ptr() != ptr or storage.nbytes() < need:
            raise _moved(layer)
    for layer, a, ptr, nbytes, fast in numpy_g:
        if a.nbytes != nbytes or _array_ptr(a, fast) != ptr:
            raise _moved(layer)


def _array_ptr(a: np.ndarray, fast: bool) -> int:
    """A numpy array's data pointer."""
    if fast:
        try:
            return ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]
        except (TypeError, ValueError, BufferError):
            pass  # no longer writable or contiguous: the slow way
    return int(a.__array_interface__["data"][0])


def _moved(layer: int) -> LayoutError:
    return LayoutError(f"KV cache tensor of layer {layer} moved or was resized since register_kv_caches: register "
                       "the caches again (close() this store, then register_kv_caches with the tensors as they "
                       "are now)")


def _block_array(block_ids: Any) -> np.ndarray:
    a = np.asarray(block_ids)
    if a.ndim != 1:
        raise LayoutError(f"block_ids must be one-dimensional, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise LayoutError(f"block_ids must be integers, got {a.dtype}")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:  # would wrap to SKIP_BLOCK and below
        raise LayoutError(f"block id {int(a.max())} out of range")
    return np.ascontiguousarray(a, dtype=np.int64)


class TuttiStore:
    """One store instance: a share of the node's file pool, its index, queues and agent."""

    def __init__(self, config: TuttiConfig | None = None, **overrides: Any) -> None:
        if config is not None and not isinstance(config, TuttiConfig):
            raise ConfigError(f"config must be a TuttiConfig, not {type(config).__name__}")
        if config is None or overrides:  # overrides are validated like any other setting
            config = load_config(**{**(config.model_dump() if config else {}), **overrides})
        self.config = config
        self._native: Any = None
        self._ops: dict[int, Any] = {}
        self._keys: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self.block_tokens = 0
        self.num_layers = 0
        self.device = "cpu"
        self.on_commit: Callable[[int], None] | None = None
        self.on_evict: Callable[[int], None] | None = None
        self._kv_refs: list[Any] = []
        self._guards: _Guards = ([], [])  # every registered tensor's memory guard (_kv_guards)
        self._layer_guards: list[_Guards] = []  # ... and each layer's
        self._host_regions: dict[int, memoryview] = {}  # register_host: address -> the exported view
        self._scatters: dict[int, memoryview] = {}  # scatter_unit_async: ticket -> the unit's bytes

    # ---- setup -------------------------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: Sequence[Any], *, block_tokens: int, layout: Layout = "auto", read_only: bool = False
    ) -> None:
        """Registers the engine's per-layer paged KV tensors (or :class:`LayerKV` descriptors).

        Builds the extent map, opens (creating and preallocating) the pool files, rebuilds the index
        from their headers and starts the queues. ``read_only`` opens existing pools for lookups and
        ``read_unit`` only (no queues, no writes, no KV memory touched): :meth:`open_pools` with the
        layers' geometry.

        The store keeps the tensors and their memory (torch storages) while registered, and every call
        that hands the native core work on the KV memory raises LayoutError once a registered tensor
        moved or shrank (``t.set_()``, ``t.resize_()``, ``t.untyped_storage().resize_()``): then
        :meth:`close` and register the caches again. Tensors may be written in place freely. Not seen:
        numpy's ``resize(refcheck=False)`` of an array a tensor was made from (``torch.from_numpy``),
        which turns off numpy's own check that nothing else uses the memory.
        """
        if self._native is not None:
            raise ConfigError("KV caches are already registered")
        if not kv_caches:
            raise LayoutError("no KV cache layers given")
        if block_tokens <= 0:
            raise LayoutError("block_tokens must be positive")
        if self.config.unit_tokens % block_tokens:
            raise ConfigError(f"unit_tokens ({self.config.unit_tokens}) must be a multiple of block_tokens ({block_tokens})")
        layers = [l if isinstance(l, LayerKV) else layer_kv_from_tensor(l, layout) for l in kv_caches]
        desc = describe(layers)
        device = layers[0].device
        if read_only:  # the unit store alone: it never touches the KV memory
            l0 = layers[0]
            self.open_pools(num_layers=len(layers), objs_per_layer=len(l0.ptrs), block_bytes=l0.block_bytes,
                            block_tokens=block_tokens, dtype=l0.dtype, block_shape=l0.block_shape)
            self._layers, self.device = layers, device
            return
        backend = self.config.backend
        if backend == "auto":
            backend = "cuda" if device == "cuda" else "cpu"
        if backend == "cuda" and not _native.has_cuda:
            raise DeviceError("backend 'cuda' requested but this build has no CUDA support")
        if (backend == "cuda") != (device == "cuda"):
            raise DeviceError(f"backend '{backend}' cannot move KV tensors that live on {device}")
        unit_blocks = self.config.unit_tokens // block_tokens
        obj = unit_blocks * layers[0].block_bytes
        if obj < self.config.min_io_bytes:
            # Usual on small models (few KV heads): everything works, each disk I/O is only smaller
            # than the size the layout aims for.
            log.info("store %s: each storage I/O moves one object (a unit's KV of one layer) of %d bytes, below "
                     "min_io_bytes=%d, so disk bandwidth may fall short of the disk's best; usual for small models. "
                     "Raise unit_tokens (now %d) for larger I/Os, or lower min_io_bytes to silence this",
                     self.config.instance, obj, self.config.min_io_bytes, self.config.unit_tokens)
        if not self.config.paths:  # embedded default only: <data_dir>/store, owner-only as made
            gid = group_id(self.config.file_group)
            make_dir(self.config.data_dir, gid)
            make_dir(self.config.storage_paths()[0], gid)
        if self.config.prewrite_pool:
            for p, cap in zip(self.config.storage_paths(), self.config.capacity_bytes()):
                pool = p / f"tutti-{self.config.instance}.pool"
                if not pool.exists() or pool.stat().st_size < cap // max(1, self.config.pool_files) // 2:
                    log.info("creating the cache files in %s (%.1f GiB); they are filled once now so that "
                             "later stores never wait for the disk to allocate space", p, cap / (1 << 30))
        guards, layer_guards = _kv_guards(layers)
        options = native_options(self.config, backend=backend, unit_blocks=unit_blocks)
        descs = [_native.LayerKVDesc(list(l.ptrs), l.block_stride, l.block_bytes, l.num_blocks) for l in layers]
        nat = _native.Store.open(options, descs, desc)
        try:
            nat.init_queue(self.config.iocb_depth)
        except TuttiError:
            nat.close()
            raise
        self._native = nat
        # The native store holds raw pointers into these tensors: keep them and their storages alive
        # as long as it lives, and check at every request that their memory is still in place.
        self._kv_refs = list(kv_caches)
        self._guards, self._layer_guards = guards, layer_guards
        self.block_tokens = block_tokens
        self.num_layers = len(layers)
        self.device = device
        self._layers = layers
        if device == "cuda":
            import torch  # only CUDA stores need it

            # The caller's current stream, as a raw handle: the native layer call records its
            # ordering event there (torch's own cheap accessor where this torch has it).
            index = self.config.device
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            self._current_stream: Callable[[], int] = (
                functools.partial(raw, index) if raw is not None
                else lambda: int(torch.cuda.current_stream(index).cuda_stream)
            )
        log.info("store %s: %d layers, %s, %d blocks/unit, GPU file %d bytes, backend %s",
                 self.config.instance, len(layers), desc, unit_blocks, nat.geometry().slot_bytes, backend)
        if backend == "cuda" and self.config.memory_paths and not self.config.copy_engine_mb:
            log.info("store %s: the I/O kernel loads the memory tier's units over PCIe itself; copy_engine_mb=1024 "
                     "moves them with the copy engine instead, nearer the host-to-GPU limit, for host CPU per unit "
                     "in each layer call and that much GPU memory (docs/CUDA.md)", self.config.instance)

    def open_pools(self, *, num_layers: int, objs_per_layer: int, block_bytes: int, block_tokens: int,
                   dtype: str = "", block_shape: Sequence[int] = ()) -> None:
        """Opens this instance's existing pools for reading only, from the KV geometry alone (no KV
        memory): lookups, ``read_unit``/``read_unit_into`` and ``refresh``, as the node daemon
        does. The geometry is what the engine registered (``dtype`` and ``block_shape`` as its
        layers describe them), so that the headers' layout matches."""
        if self._native is not None:
            raise ConfigError("KV caches are already registered")
        if block_tokens <= 0 or self.config.unit_tokens % block_tokens:
            raise ConfigError(f"unit_tokens ({self.config.unit_tokens}) must be a multiple of block_tokens ({block_tokens})")
        unit_blocks = self.config.unit_tokens // block_tokens
        options = native_options(self.config, backend="cpu", unit_blocks=unit_blocks, read_only=True)
        desc = describe_block(dtype, block_shape, block_bytes, objs_per_layer)
        self._native = _native.UnitStore.open(options, num_layers, objs_per_layer, block_bytes, desc)
        self.block_tokens = block_tokens
        self.num_layers = num_layers
        self._layers = []

    @property
    def _e(self) -> Any:
        """The engine session (register_kv_caches without read_only)."""
        n = self._n
        if not isinstance(n, _native.Store):
            raise TuttiError("this store was opened read-only: it has no queues (lookups and reads only)")
        return n

    @property
    def _n(self) -> Any:
        if self._native is None:
            raise TuttiError("register_kv_caches() first (or the store is closed)")
        return self._native

    @property
    def layers(self) -> list[LayerKV]:
        """The registered per-layer KV descriptors."""
        _ = self._n  # raises when closed
        return list(self._layers)

    @property
    def unit_blocks(self) -> int:
        """KV blocks per cache unit."""
        return int(self._n.geometry().unit_blocks)

    @property
    def unit_tokens(self) -> int:
        return self.config.unit_tokens

    def geometry(self) -> dict[str, int]:
        """Sizes of a GPU file: objects, header, slot."""
        return struct_dict(self._n.geometry())

    # ---- lookups -------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[Key]) -> int:
        """Number of leading cache units of ``keys`` present in this store."""
        return int(self._n.lookup(key_array(keys)))

    def contains(self, key: Key) -> bool:
        return self.lookup([key]) == 1

    def stored_blocks(self, keys: Sequence[Key]) -> list[int]:
        """KV blocks each unit of ``keys`` holds: ``unit_blocks`` for a whole unit, fewer for a
        prefix's partial last unit, 0 when absent.

        A request's last unit may be partial: for ``n`` keys, ``begin_store``/``begin_retrieve`` take
        ``(n - 1) * unit_blocks + 1`` up to ``n * unit_blocks`` block ids, and a retrieve asks a unit
        for at most the blocks it holds (more is a miss, never zeros presented as KV).
        """
        return [int(b) for b in self._n.stored_blocks(key_array(keys))]

    # ---- engine API ----------------------------------------------------------------------------
    def begin_retrieve(self, keys: Sequence[Key], block_ids: Any) -> int:
        """Hands a request's unit keys and destination block ids over once; returns its handle.

        A block id of :data:`SKIP_BLOCK` leaves that block as it is: the unit's bytes for it are
        read and checked with the rest of the unit, and placed nowhere.
        """
        return self._begin(_RETRIEVE, keys, block_ids)

    def begin_store(self, keys: Sequence[Key], block_ids: Any,
                    inner_keys: Sequence[Sequence[Key]] | None = None) -> int:
        """Reserves GPU files for the units not yet stored; returns the request handle.

        ``inner_keys``, one list per unit: the keys a unit ending after each of its blocks but the
        last would have (for a prefix cache: the hash of the prefix up to that block). They are
        committed in the unit's header, and :meth:`inner_keys` names the unit by them, so that a
        prefix sharing only the unit's leading blocks can find and load those blocks.
        """
        if inner_keys is None:
            return self._begin(_STORE, keys, block_ids)
        lists = _inner_lists(inner_keys)
        if len(lists) != len(keys):
            raise LayoutError(f"{len(lists)} lists of inner keys for {len(keys)} units")
        flat = [k for ks in lists for k in ks]
        counts = np.array([len(ks) for ks in lists], dtype=np.uint32)
        return self._begin(_STORE, keys, block_ids, key_array(flat), counts)

    def _check_kv(self) -> None:
        """LayoutError when a registered KV tensor moved or shrank: run before any call that hands the
        native core work on the KV memory (once per request and per layer call, not per block)."""
        _check_guards(self._guards)

    def _check_kv_layer(self, layer: Any) -> None:
        """:meth:`_check_kv` for the tensors of one layer (a layer call moves that layer only)."""
        g = self._layer_guards
        if type(layer) is int and 0 <= layer < len(g):
            _check_guards(g[layer])
        else:  # not a layer index the native call will accept; check them all anyway
            _check_guards(self._guards)

    def _begin(self, op: Any, keys: Sequence[Key], block_ids: Any, inner: Any = None, counts: Any = None) -> int:
        self._check_kv()
        k = key_array(keys)
        req = int(self._e.begin(op, k, _block_array(block_ids), inner, counts))
        with self._lock:
            self._ops[req] = op
            self._keys[req] = k
        self._drain_evicted()
        return req

    def _check(self, req: int, op: Any) -> None:
        have = self._ops.get(req)
        if have is None:
            raise TuttiError(f"no request {req} in flight")
        if have != op:
            raise TuttiError(f"request {req} is a {'retrieve' if have == _RETRIEVE else 'store'} request")

    def _order_stream(self, event: int) -> int:
        """The stream (handle; 0 is the default stream) the layer's I/O is ordered after when no
        ``event`` is given: the caller's current stream on CUDA stores; -1 (none) otherwise."""
        return self._current_stream() if not event and self.device == "cuda" else -1

    def retrieve_layer(self, layer: int, req: int, event: int = 0) -> None:
        """Starts moving ``layer`` of the request from storage into its KV blocks (asynchronous).

        On CUDA the I/O kernel starts after ``event`` (a ``cudaEvent_t`` handle), or, when 0, after
        the work queued so far on the caller's current stream.
        """
        self._check(req, _RETRIEVE)
        self._check_kv_layer(layer)
        self._e.layer(layer, req, event, self._order_stream(event))

    def store_layer(self, layer: int, req: int, event: int = 0) -> None:
        """Starts writing ``layer`` of the request's KV blocks to its GPU files (asynchronous).

        On CUDA the gather starts after ``event``, or after the work queued so far on the caller's
        current stream (the kernels that wrote the KV blocks).
        """
        self._check(req, _STORE)
        self._check_kv_layer(layer)
        self._e.layer(layer, req, event, self._order_stream(event))

    def wait_layer(self, layer: int, req: int, stream: int | None = None) -> None:
        """Waits until ``layer`` of the request has moved.

        CPU stores block the calling thread. CUDA stores make ``stream`` (a ``cudaStream_t`` handle;
        None: the caller's current stream) wait for the layer's I/O kernel, without blocking the
        host; ``stream=0`` blocks the host instead.
        """
        if req not in self._ops:
            raise TuttiError(f"no request {req} in flight")
        if stream is None:
            stream = self._current_stream() if self.device == "cuda" else 0
        self._e.wait_layer(layer, req, stream)

    def compute_stream(self) -> int:
        """A ``cudaStream_t`` handle on the SMs outside the I/O partition (CUDA stores with green
        contexts), for the engine's compute; 0 when there is none."""
        return int(self._e.compute_stream())

    def done(self, req: int) -> bool:
        """Whether the request's I/O issued so far is complete, without waiting (``finish`` then
        returns at once): how a caller lets writes run on while it does other work."""
        if req not in self._ops:
            raise TuttiError(f"no request {req} in flight")
        return bool(self._e.done(req))

    def finish(self, req: int) -> RequestResult:
        """Completes a request: commits stored units, unpins retrieved ones, reports failures."""
        # The request's entry goes before the native finish frees its id, which another thread's
        # begin may then take at once.
        with self._lock:
            if req not in self._ops:
                raise TuttiError(f"no request {req} in flight")
            self._ops.pop(req)
            keys = self._keys.pop(req)
        fields = struct_dict(self._e.finish(req))
        fields["failures"] = [UnitFailure.from_native(f) for f in fields["failures"]]
        res = RequestResult(**fields)
        if self.on_commit is not None:
            for u in res.committed_units:
                self.on_commit(int(keys[u]))
        self._drain_evicted()
        return res

    def retrieve(self, keys: Sequence[Key], block_ids: Any) -> RequestResult:
        """Retrieves every layer of a request and waits for it."""
        req = self.begin_retrieve(keys, block_ids)
        for layer in range(self.num_layers):
            self.retrieve_layer(layer, req)
        return self.finish(req)

    def store(self, keys: Sequence[Key], block_ids: Any,
              inner_keys: Sequence[Sequence[Key]] | None = None) -> RequestResult:
        """Stores every layer of a request and commits it (``inner_keys``: see :meth:`begin_store`)."""
        req = self.begin_store(keys, block_ids, inner_keys)
        for layer in range(self.num_layers):
            self.store_layer(layer, req)
        return self.finish(req)

    # ---- gio_uring -----------------------------------------------------------------------------
    def get_iocb(self, n: int) -> list[int]:
        """Takes ``n`` free IOCBs from the table made by ``init_queue`` (at registration)."""
        return list(self._e.get_iocb(n))

    def fill_iocb(self, iocb: int, *, op: str, layer: int, req: int, first: int, count: int) -> None:
        """Points an IOCB at IOCTXs ``[first, first + count)`` of request ``req`` (op: read|write)."""
        codes = {"read": _native.IoOp.READ, "write": _native.IoOp.WRITE}
        if op not in codes:
            raise TuttiError(f"op must be one of {sorted(codes)}")
        self._e.fill_iocb(iocb, codes[op], layer, req, first, count)

    def issue_io(self, iocbs: Sequence[int], sms: int = 0, event: int = 0) -> None:
        """Enqueues the I/O kernel for these IOCBs on ``sms`` SMs (0: the configured io_sms)."""
        self._check_kv()
        self._e.issue_io(list(iocbs), sms, event)

    def wait_cqe(self, iocb: int) -> int:
        """Waits for an IOCB; returns how many of its IOCTXs failed."""
        return int(self._e.wait_cqe(iocb))

    def put_iocb(self, iocb: int) -> None:
        self._e.put_iocb(iocb)

    # ---- CPU paths: replicas and remote reads ---------------------------------------------------
    def read_unit(self, key: Key) -> bytes:
        """The whole GPU file of ``key`` (header and objects), read on the CPU and verified."""
        return bytes(self._n.read_unit(to_key(key)))

    def read_unit_into(self, key: Key, out: Any, verify: bool = True) -> int:
        """Reads and verifies the GPU file of ``key`` into the writable buffer ``out``; returns its size.

        With a 4 KiB-aligned buffer (e.g. one registered with a transfer engine) the read lands in
        place with O_DIRECT, with no copy. Raises NotFound for an absent or corrupt unit.
        ``verify=False`` checks only the header (key and layout) and leaves the per-object checksums
        to whoever consumes the bytes (``scatter_unit`` and ``import_unit`` verify them): the node
        daemon serves remote reads this way, so that each byte is summed once, at the requester.
        """
        return int(self._n.read_unit_into(to_key(key), out, verify))

    def refresh(self) -> None:
        """Read-only stores: rescans the headers for units committed since open."""
        self._n.refresh()

    def import_unit(self, data: bytes | bytearray | memoryview) -> int:
        """Commits a GPU file (as :meth:`read_unit` returns it) into this store; returns its key."""
        key = int(self._n.import_unit(data))
        if self.on_commit is not None:
            self.on_commit(key)
        self._drain_evicted()
        return key

    def scatter_unit(self, data: bytes | bytearray | memoryview, block_ids: Any) -> None:
        """Scatters a GPU file's bytes into one unit's KV blocks, verifying them as it copies.

        Works on every backend: on CUDA a kernel reads the unit from host memory in place when it is
        in memory given to :meth:`register_host` (else from a pinned copy) and returns once the
        blocks are written. Raises NotFound (a miss) when the header or an object fails its
        checksum (the blocks then hold no valid KV), DeviceError when the device fails. Block ids of
        :data:`SKIP_BLOCK` are checked and not written, as in :meth:`begin_retrieve`.
        """
        self._check_kv()
        self._e.scatter_unit(data, _block_array(block_ids))

    def scatter_unit_async(self, data: bytes | bytearray | memoryview, block_ids: Any, key: Key | None = None) -> int:
        """:meth:`scatter_unit`, ordered on the caller's current stream and returning at once: a
        ticket for :meth:`scatter_wait`, which gives the verdict.

        On CUDA the scatter starts after the work queued on the current stream so far and the work
        queued there afterwards waits for it, as for a retrieve's layer; the host does not wait. The
        store keeps ``data`` (the buffer, unchanged) until :meth:`scatter_wait`. At most four are in
        flight, :meth:`scatter_unit`'s included (CapacityExceeded beyond). Bad arguments and a
        header that fails raise here, as for :meth:`scatter_unit`, and so does (NotFound) a unit
        whose header names another key than ``key``, when given; the objects' checksums are judged
        by :meth:`scatter_wait`.
        """
        self._check_kv()
        view = memoryview(data)
        try:
            want = None if key is None else to_key(key)
            ticket = int(self._e.scatter_unit_async(view, _block_array(block_ids), self._order_stream(0), want))
        except BaseException:
            view.release()
            raise
        self._scatters[ticket] = view
        return ticket

    def scatter_wait(self, ticket: int) -> None:
        """Waits for the scatter of ``ticket`` (an int; each is waited for once). Returns when its
        blocks hold the unit, for the host and for any stream; raises NotFound (a miss: the blocks
        hold no valid KV) when an object failed its checksum, DeviceError when the device failed, and
        TuttiError for a ticket not in flight (being waited for elsewhere included)."""
        if isinstance(ticket, bool) or not hasattr(ticket, "__index__"):
            raise TypeError(f"a scatter ticket is an int, not {type(ticket).__name__}")
        t = operator.index(ticket)
        try:
            self._e.scatter_wait(t)
        except (NotFound, DeviceError):
            self._release_scatter(t)  # the wait took the ticket: its verdict is this error
            raise
        # A plain TuttiError (no such ticket in flight) leaves the buffer to whoever holds the ticket.
        self._release_scatter(t)

    def _release_scatter(self, ticket: int) -> None:
        view = self._scatters.pop(ticket, None)
        if view is not None:
            view.release()

    def register_host(self, buffer: Any) -> int:
        """Lets :meth:`scatter_unit` read units in ``buffer`` (host memory, e.g. the Transfer
        Engine's staging arena) in place: a GPU backend maps it. Returns its address, for
        :meth:`unregister_host`; the store keeps ``buffer`` exported until then or :meth:`close`.
        A no-op on the CPU backend."""
        view = memoryview(buffer)
        addr = int(self._e.register_host(view))
        if addr in self._host_regions:  # one registration per address: one unregister undoes it
            view.release()
            raise ConfigError(f"host memory at {addr:#x} is registered already")
        self._host_regions[addr] = view
        return addr

    def unregister_host(self, addr: int) -> None:
        """Undoes :meth:`register_host` (nothing for an address it did not return)."""
        view = self._host_regions.pop(addr, None)
        if view is not None:
            if self._native is not None:
                self._native.unregister_host(addr)
            view.release()

    # ---- capacity ----------------------------------------------------------------------------
    def pin(self, keys: Sequence[Key], memory: bool = False) -> int:
        """Protects units from eviction (counted: pin twice, unpin twice); a pinned unit's memory
        copy is never demoted. ``memory=True`` also calls :meth:`promote` on them; returns how many copies
        into memory were queued."""
        a = key_array(keys)
        self._n.pin(a, True)
        return int(self._n.promote(a)) if memory else 0

    def promote(self, keys: Sequence[Key]) -> int:
        """Queues each unit of ``keys`` that lies on storage only for a copy into the memory tier,
        made in the background (verified on the way); returns how many were queued (0 without a
        memory tier). A pinned unit then stays in memory."""
        return int(self._n.promote(key_array(keys)))

    def unpin(self, keys: Sequence[Key]) -> None:
        self._n.pin(key_array(keys), False)

    def remove(self, key: Key) -> bool:
        """Drops a unit; returns whether it was dropped: False when absent, and when it is pinned or
        being read (it stays; ``contains`` tells the two apart)."""
        k = to_key(key)
        gone = bool(self._n.remove(k))
        if gone and self.on_evict is not None:
            self.on_evict(k)
        return gone

    def keys(self) -> list[int]:
        """Keys present, most recently used first."""
        return [int(k) for k in self._n.keys()]

    def unit_tiers(self, keys: Sequence[Key]) -> list[str]:
        """Where each unit of ``keys`` lies: ``"memory"`` (in the memory tier only, its storage copy
        not yet written), ``"storage"``, ``"both"``, or ``""`` when absent."""
        return [_TIERS[t] for t in self._n.unit_tiers(key_array(keys))]

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until the memory tier's background copies are done: every unit stored into it has
        its storage copy (``write_back``) and every promotion due is made; at most ``timeout_s``
        seconds. True when none is left waiting; at once without a memory tier."""
        if timeout_s is not None and not timeout_s >= 0:
            raise ConfigError(f"flush timeout_s must be None or a number of seconds >= 0, not {timeout_s!r}")
        return bool(self._n.flush(-1.0 if timeout_s is None or math.isinf(timeout_s) else timeout_s))

    def inner_keys(self) -> dict[int, int]:
        """Inner key -> the key of the stored unit it lies in (see :meth:`begin_store`)."""
        a = self._n.inner_keys()
        return {int(a[i]): int(a[i + 1]) for i in range(0, len(a), 2)}

    def _drain_evicted(self) -> None:
        evicted = self._n.drain_evicted()
        if self.on_evict is not None:
            for k in evicted:
                self.on_evict(int(k))

    def stats(self) -> dict[str, Any]:
        """Counters and sizes of this instance."""
        return struct_dict(self._n.stats())

    def close(self) -> None:
        """Finishes requests in flight, stops the queues and releases the pool files."""
        if self._native is not None:
            self._native.close()
            self._native = None
            self._kv_refs = []
            self._guards, self._layer_guards = ([], []), []
            for view in (*self._host_regions.values(), *self._scatters.values()):
                view.release()
            self._host_regions = {}
            self._scatters = {}

    def __enter__(self) -> "TuttiStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pool_files(config: TuttiConfig) -> list[Path]:
    """The pool files of ``config.instance`` on its storage and memory paths (``tutti-<instance>.pool``
    and ``tutti-<instance>.<n>.pool``; never another instance's, whose names may hold dots too)."""
    pattern = re.compile(re.escape(f"tutti-{config.instance}") + r"(\.[0-9]+)?\.pool")
    dirs = [*config.storage_paths(), *config.memory_paths]
    return sorted(f for p in dirs if p.is_dir() for f in p.iterdir() if pattern.fullmatch(f.name))

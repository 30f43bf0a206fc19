"""Type stub of the native core (native/bindings/module.cc)."""

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

has_cuda: bool
MAX_IOCTX_PER_IOCB: int
FLUSH_COPIERS: int
FLUSH_PARTS: int

def crc32c(data: Any, crc: int = 0) -> int: ...

class LayerKVDesc:
    def __init__(self, ptrs: Sequence[int], block_stride: int, block_bytes: int, num_blocks: int) -> None: ...

class ReqOp:
    RETRIEVE: ReqOp
    STORE: ReqOp

class IoOp:
    READ: IoOp
    WRITE: IoOp

class StoreOptions:
    paths: list[str]
    capacity: list[int]
    memory_paths: list[str]
    memory_capacity: list[int]
    write_policy: Literal["write_back", "write_through", "memory_only"]
    promote_hits: int
    promote_window_s: float
    instance: str
    pool_files: int
    prewrite_pool: bool
    unit_blocks: int
    queue_depth: int
    staging_mb: int
    max_requests: int
    io_sms: int
    min_io_bytes: int
    direct_io: Literal["auto", "on", "off"]
    backend: str
    device: int
    cuda_pair: bool
    copy_engine_mb: int
    cuda_trace: bool
    read_only: bool
    map_memory_paths: bool
    file_gid: int
    def __init__(self) -> None: ...

class Geometry:
    num_layers: int
    objs_per_layer: int
    unit_blocks: int
    block_bytes: int
    obj_bytes: int
    header_bytes: int
    slot_bytes: int
    layout_id: int

class StoreStats:
    units: int
    pinned: int
    free_slots: int
    total_slots: int
    hits: int
    lookups: int
    evictions: int
    checksum_failures: int
    io_errors: int
    bad_headers: int
    memory_units: int
    memory_slots: int
    memory_free_slots: int
    memory_hits: int
    storage_hits: int
    memory_bytes_read: int
    promotions: int
    demotions: int
    flushes: int
    flush_bytes: int
    flush_errors: int
    flush_backlog: int
    bytes_read: int
    bytes_written: int
    agent_ops: int
    agent_cpu_s: float
    kernel_cpu_s: float
    direct_ios: int
    copy_engine_bytes: int
    extent_map_bytes: int
    request_map_peak_bytes: int
    staging_bytes: int
    slot_bytes: int
    obj_bytes: int
    direct_io: bool
    fixed_buffers: bool
    mapped_files: int
    backend: str

class UnitFailure:
    unit: int
    key: int
    cause: str
    error: int
    pool_file: str
    slot: int | None
    offset: int

class RequestResult:
    units: int
    failed_units: list[int]
    failures: list[UnitFailure]
    skipped_units: int
    committed_units: list[int]
    incomplete_layers: list[int]

class UnitStore:
    @staticmethod
    def open(options: StoreOptions, num_layers: int, objs_per_layer: int, block_bytes: int, desc: str) -> UnitStore: ...
    def lookup(self, keys: npt.NDArray[np.uint64]) -> int: ...
    def stored_blocks(self, keys: npt.NDArray[np.uint64]) -> list[int]: ...
    def read_unit(self, key: int) -> bytes: ...
    def read_unit_into(self, key: int, out: Any, verify: bool = True) -> int: ...
    def refresh(self) -> None: ...
    def import_unit(self, data: Any) -> int: ...
    def pin(self, keys: npt.NDArray[np.uint64], on: bool) -> None: ...
    def promote(self, keys: npt.NDArray[np.uint64]) -> int: ...
    def remove(self, key: int) -> bool: ...
    def keys(self) -> list[int]: ...
    def unit_tiers(self, keys: npt.NDArray[np.uint64]) -> list[int]: ...
    def flush(self, timeout_s: float = -1.0) -> bool: ...
    def inner_keys(self) -> npt.NDArray[np.uint64]: ...
    def drain_evicted(self) -> list[int]: ...
    def geometry(self) -> Geometry: ...
    def stats(self) -> StoreStats: ...
    def close(self) -> None: ...

class Store(UnitStore):
    @staticmethod
    def open(options: StoreOptions, layers: Sequence[LayerKVDesc], desc: str) -> Store: ...  # type: ignore[override]
    def init_queue(self, depth: int) -> None: ...
    def begin(self, op: ReqOp, keys: npt.NDArray[np.uint64], blocks: npt.NDArray[np.int64],
              inner: npt.NDArray[np.uint64] | None = None, inner_counts: npt.NDArray[np.uint32] | None = None) -> int: ...
    def layer(self, layer: int, request: int, event: int = 0, stream: int = -1) -> None: ...
    def wait_layer(self, layer: int, request: int, stream: int = 0) -> None: ...
    def finish(self, request: int) -> RequestResult: ...
    def done(self, request: int) -> bool: ...
    def get_iocb(self, n: int) -> list[int]: ...
    def fill_iocb(self, iocb: int, op: IoOp, layer: int, request: int, first: int, count: int) -> None: ...
    def issue_io(self, ids: Sequence[int], sms: int = 0, event: int = 0) -> None: ...
    def wait_cqe(self, iocb: int) -> int: ...
    def put_iocb(self, iocb: int) -> None: ...
    def scatter_unit(self, data: Any, blocks: npt.NDArray[np.int64]) -> None: ...
    def scatter_unit_async(
        self, data: Any, blocks: npt.NDArray[np.int64], stream: int, key: int | None = None
    ) -> int: ...
    def scatter_wait(self, ticket: int) -> None: ...
    def register_host(self, data: Any) -> int: ...
    def unregister_host(self, addr: int) -> None: ...
    def compute_stream(self) -> int: ...

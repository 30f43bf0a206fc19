"""The benchmark's KV cache: Llama-3-8B-shaped paged tensors with known, checkable contents.

All layers live in one allocation ``[layers, 2, num_blocks, block_tokens, kv_heads, head_size]``
(bf16); ``layers[l]`` is layer ``l``'s ``[2, num_blocks, block_tokens, kv_heads, head_size]``
tensor, vLLM's "kv_first" paged layout.  A prefix of ``n`` blocks occupies physical blocks
``0..n-1`` in a random permutation.

Contents are derived from a random *pool*: logical object ``(layer, kv, i)`` holds the 32 KiB of
the pool starting at ``layer_offset(layer) + (kv * n + i) * object_bytes``.  Layer offsets differ by
64 bytes, so no two objects of a prefix have equal contents and any misplaced, missing or partly
written object is caught by an exact comparison against the pool, with no reference copy of the
whole cache in memory.

``tutti bench tiers`` keeps a catalogue of units in the same tensors: unit ``g``'s objects are those
of a ``unit_blocks``-block prefix read from the pool ``g * unit_stride`` elements further on
(:meth:`KVData.fill` and :meth:`KVData.check` at ``offset``; ``extra_pool_elems`` makes the room).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tutti_cluster.bench.errors import BenchVerificationError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVShape:
    """Model and paging shape; the defaults are Llama-3-8B with vLLM's 16-token blocks."""

    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    block_tokens: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def object_bytes(self) -> int:
        """Bytes of one block's K (or V) for one layer: 32 KiB for Llama-3-8B."""
        return self.block_tokens * self.kv_heads * self.head_size * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V: 2 MiB for Llama-3-8B."""
        return 2 * self.layers * self.object_bytes

    def prefix_bytes(self, tokens: int) -> int:
        """KV bytes of a prefix of ``tokens`` tokens (all layers, K and V)."""
        return tokens // self.block_tokens * self.block_bytes


LLAMA3_8B = KVShape()

# Distance between layers' starting points in the pool, in int64 elements (64 bytes).
_LAYER_SKEW = 8


class KVData:
    """Paged KV tensors for up to ``max_blocks`` blocks, with placement and verification.

    ``place(n)`` puts a prefix of ``n`` blocks into physical blocks under a random permutation
    and returns it (the block ids of logical blocks ``0..n-1``); ``clear(n)`` zeroes them;
    ``verify(n, ids)`` checks that logical block ``i`` sits, byte-exact in every layer, at
    ``ids[i]``, and raises :class:`BenchVerificationError` otherwise. ``fill(ids, offset)`` and
    ``check(ids, system, offset)`` do the same for contents taken ``offset`` int64 elements further
    into the pool (``extra_pool_elems`` beyond what one prefix of ``max_blocks`` blocks needs).
    """

    def __init__(self, shape: KVShape, max_blocks: int, device: torch.device, seed: int = 0,
                 extra_pool_elems: int = 0) -> None:
        self.shape = shape
        self.max_blocks = max_blocks
        self.device = device
        self._rng = np.random.default_rng(seed)
        s = shape
        self.all = torch.empty(
            (s.layers, 2, max_blocks, s.block_tokens, s.kv_heads, s.head_size), dtype=s.dtype, device=device
        )
        # Touch every page now so that first-touch faults land in no timed pass.
        self.all.zero_()
        self.layers: list[torch.Tensor] = [self.all[l] for l in range(s.layers)]
        # Copies and comparisons go through int64 views: fewer, wider elements, and bitwise (bf16
        # NaNs compare unequal to themselves).
        self._elems = s.object_bytes // 8  # int64 elements per object
        pool_elems = 2 * max_blocks * self._elems + _LAYER_SKEW * s.layers + extra_pool_elems
        host_pool = torch.from_numpy(self._rng.integers(-(2**63), 2**63 - 1, size=pool_elems, dtype=np.int64))
        self._pool = host_pool.to(device) if device.type != "cpu" else host_pool
        self._check = torch.zeros(2 * max_blocks * self._elems, dtype=torch.int64, device=device)
        self._placed: tuple[int, torch.Tensor] | None = None

    @staticmethod
    def catalogue_elems(shape: KVShape, units: int) -> int:
        """``extra_pool_elems`` for a catalogue of ``units`` units (see :meth:`unit_offset`)."""
        return units * _LAYER_SKEW * (shape.layers + 1)

    def unit_offset(self, unit: int) -> int:
        """Pool offset (int64 elements) of catalogue unit ``unit``'s contents: units lie one skew
        more apart than the layers span, so no two units' objects start at the same element."""
        return unit * _LAYER_SKEW * (self.shape.layers + 1)

    @property
    def nbytes(self) -> int:
        """Device bytes held: the KV tensors, the pool and the verification buffer."""
        return self.all.numel() * 2 + (self._pool.numel() + self._check.numel()) * 8

    def _flat(self, layer: int) -> torch.Tensor:
        return self.all[layer].view(torch.int64).view(2, self.max_blocks, self._elems)

    def _expected(self, layer: int, n: int, offset: int = 0) -> torch.Tensor:
        start = offset + layer * _LAYER_SKEW
        return self._pool[start : start + 2 * n * self._elems].view(2, n, self._elems)

    def permutation(self, n: int) -> torch.Tensor:
        """A random permutation of physical blocks ``0..n-1`` (int64, CPU)."""
        if not 0 < n <= self.max_blocks:
            raise ValueError(f"prefix of {n} blocks does not fit {self.max_blocks} blocks")
        return torch.from_numpy(self._rng.permutation(n).astype(np.int64))

    def place(self, n: int) -> torch.Tensor:
        """Ensure the ``n``-block prefix is in the tensors; return its block ids (int64, CPU).

        Data left in place by the last verified retrieve of the same prefix is reused as is.
        """
        if self._placed is not None and self._placed[0] == n:
            return self._placed[1]
        ids = self.permutation(n)
        self.fill(ids)
        self._placed = (n, ids)
        return ids

    def fill(self, ids: torch.Tensor, offset: int = 0) -> None:
        """Writes logical blocks ``0..len(ids)-1`` (contents ``offset`` elements into the pool) at
        physical blocks ``ids``."""
        n = len(ids)
        ids_dev = ids.to(self.device)
        for layer in range(self.shape.layers):
            self._flat(layer).index_copy_(1, ids_dev, self._expected(layer, n, offset))
        self._placed = None

    def clear_blocks(self, ids: torch.Tensor) -> None:
        """Zero physical blocks ``ids`` of every layer, K and V."""
        self.all.index_fill_(2, ids.to(self.device), 0)
        self._placed = None

    def clear(self, n: int) -> None:
        """Zero physical blocks ``0..n-1`` of every layer, K and V."""
        self.all[:, :, :n].zero_()
        self._placed = None

    def verify(self, n: int, ids: torch.Tensor, system: str) -> None:
        """Check every byte of the ``n``-block prefix at block ids ``ids``; raise on mismatch."""
        self.check(ids[:n], system)
        self._placed = (n, ids)

    def check(self, ids: torch.Tensor, system: str, offset: int = 0) -> None:
        """:meth:`verify` for the contents :meth:`fill` writes at ``offset``."""
        n = len(ids)
        ids_dev = ids.to(self.device)
        for layer in range(self.shape.layers):
            got = self._check[: 2 * n * self._elems].view(2, n, self._elems)
            torch.index_select(self._flat(layer), 1, ids_dev, out=got)
            want = self._expected(layer, n, offset)
            if not torch.equal(got, want):
                bad = (got != want).any(dim=-1).nonzero()
                kv, i = (int(x) for x in bad[0])
                raise BenchVerificationError(
                    f"{system}: wrong bytes in {len(bad)} objects of layer {layer}; first: "
                    f"{'KV'[kv]} of logical block {i} (physical block {int(ids[i])})"
                )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

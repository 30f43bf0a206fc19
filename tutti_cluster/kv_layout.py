"""Turns an engine's paged KV tensors into per-layer descriptors for the extent map.

A descriptor (:class:`LayerKV`) says where object ``kv`` (K = 0, V = 1) of block ``b`` lives:
``ptrs[kv] + b * block_stride``, ``block_bytes`` contiguous bytes. The layouts vLLM hands over:

- ``kv_first``: one tensor per layer, ``[2, num_blocks, ...]`` (FlashAttention order, and the
  CPU backend's ``[2, num_blocks, heads, block_size, head_size]``);
- ``block_first``: ``[num_blocks, 2, ...]`` (FlashInfer order);
- ``kv_tuple``: a ``(K, V)`` pair of ``[num_blocks, ...]`` tensors;
- ``interleaved``: ``[num_blocks, ...]`` with K and V interleaved inside each block (one object);
- ``mla``: ``[num_blocks, block_size, latent]`` (one object per block).

A cross-layer tensor with blocks outermost (``[num_blocks, layers, 2, ...]``) is handled by
:func:`layers_from_cross_layer_tensor`. :func:`layer_kv_from_vllm` tells these forms apart in the
tensors vLLM's ``register_kv_caches`` passes (its per-layer views, kernel-block splits, heads outside
the blocks); it needs only the tensor, not vLLM, so tools that open an engine's pool use it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any, Literal

import numpy as np

from tutti_cluster.errors import LayoutError

Layout = Literal["auto", "kv_first", "block_first", "kv_tuple", "interleaved", "mla"]


# The native descriptor's fields are unsigned 64-bit numbers.
_U64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class LayerKV:
    """Where one layer's KV objects live.

    ``owner``: the tensor (or ``(K, V)`` pair) the pointers point into, when the descriptor was made
    from one (the functions of this module set it). The store keeps it, and its memory, for as long
    as the caches are registered and refuses requests once it has moved or shrunk; a descriptor
    without an owner leaves keeping the memory in place to the caller.
    """

    ptrs: tuple[int, ...]
    block_stride: int
    block_bytes: int
    num_blocks: int
    device: str = "cpu"
    dtype: str = ""
    block_shape: tuple[int, ...] = ()
    owner: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.ptrs) not in (1, 2):
            raise LayoutError("a layer has one or two object pointers")
        if self.block_bytes <= 0 or self.num_blocks <= 0:
            raise LayoutError("block_bytes and num_blocks must be positive")
        if self.block_stride < 0 or any(p <= 0 for p in self.ptrs):
            raise LayoutError("KV blocks need positive pointers and a non-negative block stride")
        if max(self.block_stride, self.block_bytes, self.num_blocks, *self.ptrs) > _U64_MAX:
            raise LayoutError("KV block pointers, strides and counts must fit 64 bits")


def _info(t: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int, str, str]:
    """(data pointer, shape, strides in elements, element size, dtype name, device) of a tensor."""
    if isinstance(t, np.ndarray):
        # The store writes retrieved KV into these bytes and reads them as plain data.
        if t.dtype.hasobject:
            raise LayoutError(f"KV cache arrays must hold plain numbers, not {t.dtype}")
        if not t.flags.writeable:
            raise LayoutError("KV cache arrays must be writeable (a retrieve writes into them)")
        es = t.itemsize
        # numpy strides are bytes; the layout works in elements. A view over a byte buffer may step
        # by any number of bytes: rounding such a stride would name other bytes than the array's.
        for d, s in enumerate(t.strides):
            if s % es:
                raise LayoutError(f"KV cache array stride {s} (dimension {d}) is not a multiple of its element "
                                  f"size ({es} bytes, {t.dtype}): the store cannot address its blocks")
        return (t.__array_interface__["data"][0], t.shape, tuple(s // es for s in t.strides), es, str(t.dtype), "cpu")
    if hasattr(t, "data_ptr") and hasattr(t, "stride"):
        dev = str(t.device)
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size(), str(t.dtype).replace("torch.", ""),
                "cuda" if dev.startswith("cuda") else dev)
    raise LayoutError(f"KV cache must be a torch tensor or numpy array, not {type(t).__name__}")


def _contiguous_tail(shape: tuple[int, ...], strides: tuple[int, ...], start: int) -> bool:
    expect = 1
    for d in range(len(shape) - 1, start - 1, -1):
        if shape[d] != 1 and strides[d] != expect:
            return False
        expect *= shape[d]
    return True


def layer_kv_from_tensor(t: Any, layout: Layout = "auto") -> LayerKV:
    """Describes one layer's KV cache tensor (or ``(K, V)`` pair) in ``layout``."""
    if isinstance(t, (tuple, list)):
        if layout not in ("auto", "kv_tuple") or len(t) != 2:
            raise LayoutError("a (K, V) pair needs layout 'kv_tuple'")
        k, v = (_info(x) for x in t)
        if k[1] != v[1] or k[4] != v[4] or k[2] != v[2]:
            raise LayoutError("K and V tensors differ in shape, dtype or strides")
        ptr, shape, strides, es, dtype, dev = k
        if len(shape) < 2 or not _contiguous_tail(shape, strides, 1):
            raise LayoutError("each block of K and V must be contiguous")
        return LayerKV((k[0], v[0]), strides[0] * es, prod(shape[1:]) * es, shape[0], dev, dtype, tuple(shape[1:]),
                       tuple(t))
    ptr, shape, strides, es, dtype, dev = _info(t)
    if layout == "auto":
        if len(shape) >= 3 and shape[0] == 2 and shape[1] != 2:
            layout = "kv_first"
        elif len(shape) >= 3 and shape[1] == 2 and shape[0] != 2:
            layout = "block_first"
        else:
            raise LayoutError(f"cannot infer the KV layout of shape {shape}; name it (kv_first, block_first, ...)")
    if layout == "kv_first":
        if len(shape) < 3 or shape[0] != 2 or not _contiguous_tail(shape, strides, 2):
            raise LayoutError(f"kv_first needs [2, num_blocks, ...] with contiguous blocks, got {shape}")
        return LayerKV((ptr, ptr + strides[0] * es), strides[1] * es, prod(shape[2:]) * es, shape[1], dev, dtype,
                       tuple(shape[2:]), t)
    if layout == "block_first":
        if len(shape) < 3 or shape[1] != 2 or not _contiguous_tail(shape, strides, 2):
            raise LayoutError(f"block_first needs [num_blocks, 2, ...] with contiguous blocks, got {shape}")
        return LayerKV((ptr, ptr + strides[1] * es), strides[0] * es, prod(shape[2:]) * es, shape[0], dev, dtype,
                       tuple(shape[2:]), t)
    if layout in ("interleaved", "mla"):
        if len(shape) < 2 or not _contiguous_tail(shape, strides, 1):
            raise LayoutError(f"{layout} needs [num_blocks, ...] with contiguous blocks, got {shape}")
        return LayerKV((ptr,), strides[0] * es, prod(shape[1:]) * es, shape[0], dev, dtype, tuple(shape[1:]), t)
    raise LayoutError(f"unknown KV layout {layout!r}")


def layer_kv_from_vllm(t: Any, num_blocks: int) -> LayerKV:
    """Describes one layer's paged KV cache as vLLM hands it to ``register_kv_caches``.

    Accepted forms, told apart by where ``num_blocks`` sits:

    - vLLM's standardised per-layer view ``[B, H, N, C]`` (blocks outermost; K and V inside each
      block, MLA with ``H == 1``): one object per block. A view with ``k * num_blocks`` kernel blocks
      (virtual block splitting) maps ``k`` consecutive kernel blocks onto one block when they are
      dense. Views with the heads outside the blocks (``LHBNC``, ``BHLNC``) give one object per head
      run; the store takes two per block, so more than two KV heads per rank there is refused.
    - legacy ``[2, num_blocks, ...]`` (K and V planes) and a ``(K, V)`` pair of tensors.
    """
    if isinstance(t, (tuple, list)):
        return layer_kv_from_tensor(tuple(t), "kv_tuple")
    info = _info(t)  # strides in elements (a numpy stride that is not a whole number of them: LayoutError)
    ptr, shape, strides, es, dtype, dev = info
    if len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks and num_blocks != 2:
        return layer_kv_from_tensor(t, "kv_first")
    if not shape or shape[0] % num_blocks:
        raise LayoutError(f"KV cache of shape {shape} has no dimension of {num_blocks} blocks")
    ratio = shape[0] // num_blocks
    if ratio == 1:
        try:
            return layer_kv_from_tensor(t, "interleaved")
        except LayoutError:
            pass
        return _head_split(t, info)
    # ratio kernel blocks per block: only dense tensors keep a block contiguous.
    inner = prod(shape[1:])
    if not _contiguous_tail(shape, strides, 0):
        raise LayoutError(f"KV cache {shape} splits blocks into {ratio} kernel blocks and is not dense")
    return LayerKV((ptr,), inner * ratio * es, inner * ratio * es, num_blocks, dev, dtype, (ratio, *shape[1:]), t)


def _head_split(t: Any, info: tuple[int, tuple[int, ...], tuple[int, ...], int, str, str]) -> LayerKV:
    """``[B, H, N, C]`` views whose heads lie outside the blocks (LHBNC, BHLNC): one object per head.

    Each ``[N, C]`` run must be contiguous; the store takes at most two objects per block.
    """
    ptr, shape, strides, es, dtype, dev = info
    if len(shape) != 4 or strides[3] != 1 or (shape[2] > 1 and strides[2] != shape[3]):
        raise LayoutError(f"KV cache {shape} strides {strides}: a block's tokens must be contiguous")
    if shape[1] > 2:
        raise LayoutError(
            f"KV cache {shape} strides {strides} splits each block into {shape[1]} head runs; the store "
            "takes at most 2 objects per block: use a block-compact layout (VLLM_KV_CACHE_LAYOUT=LBHNC or LBNHC)"
        )
    ptrs = tuple(ptr + h * strides[1] * es for h in range(shape[1]))
    return LayerKV(ptrs, strides[0] * es, shape[2] * shape[3] * es, shape[0], dev, dtype, (shape[2], shape[3]), t)


def layers_from_cross_layer_tensor(t: Any, num_layers: int) -> list[LayerKV]:
    """Descriptors for one tensor holding every layer, blocks outermost: ``[num_blocks, layers, 2, ...]``."""
    ptr, shape, strides, es, dtype, dev = _info(t)
    if len(shape) < 4 or shape[1] != num_layers or shape[2] != 2 or not _contiguous_tail(shape, strides, 3):
        raise LayoutError(f"expected [num_blocks, {num_layers}, 2, ...] with contiguous objects, got {shape}")
    return [
        LayerKV((ptr + l * strides[1] * es, ptr + (l * strides[1] + strides[2]) * es), strides[0] * es,
                prod(shape[3:]) * es, shape[0], dev, dtype, tuple(shape[3:]), t)
        for l in range(num_layers)
    ]


def describe(layers: Sequence[LayerKV]) -> str:
    """Shape and dtype text stored in every GPU file header."""
    l0 = layers[0]
    for i, l in enumerate(layers):
        if (len(l.ptrs), l.block_bytes, l.num_blocks, l.dtype, l.block_shape) != (
            len(l0.ptrs), l0.block_bytes, l0.num_blocks, l0.dtype, l0.block_shape
        ):
            raise LayoutError(f"layer {i} differs from layer 0 in shape, dtype, block count or layout")
        if l.device != l0.device:
            raise LayoutError(f"layer {i} is on {l.device}, layer 0 on {l0.device}")
    return describe_block(l0.dtype, l0.block_shape, l0.block_bytes, len(l0.ptrs))


def describe_block(dtype: str, block_shape: Sequence[int], block_bytes: int, objs_per_layer: int) -> str:
    """The header's shape and dtype text from one layer's block description (``describe``)."""
    shape = ",".join(str(d) for d in block_shape) or str(block_bytes)
    return f"{dtype or 'bytes'}[{shape}]x{objs_per_layer}"

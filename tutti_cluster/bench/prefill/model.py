"""A decoder of a real model's shape, with random bf16 weights, over a paged KV cache.

The weights are drawn from a seeded generator on the target device (no downloads): only the shape
matters for timing, and identical seeds give identical weights, so two runs compare bit for bit.

The KV cache is one allocation ``[layers, 2, num_blocks, block_tokens, kv_heads, head_dim]``;
layer ``l``'s ``[2, num_blocks, ...]`` view is vLLM's ``kv_first`` paged layout, which
:meth:`TuttiStore.register_kv_caches` takes directly (and the benchmark's per-chunk baseline reads
and writes, :class:`PagedKV` having the attributes of ``bench.kvdata.KVData`` it uses).

A prefill takes the full token sequence, a prefix length ``P`` whose KV is (or will be, by the time
each layer's attention runs) in the cache, and the request's block table. It computes only the
suffix: per layer the suffix's Q, K and V, writes the suffix's K and V into its paged blocks, then
attends over prefix and suffix with a lower-right causal mask (query ``i`` of the suffix sees keys
``0 .. P + i``). :class:`LayerHooks` lets a caller issue and wait for the prefix's KV per layer.

Attention: on CUDA ``flex_attention`` (compiled) with a block mask built from its block indices,
never from a dense mask (``create_block_mask`` over a 128K x 128K grid asks for a dense boolean
mask of that size); SDPA (``causal_lower_right``) as the fallback and on the CPU by default
(``attention="flex"`` compiles it for the CPU too, through inductor's C++ backend: slower to
start, the same kernel code path as on CUDA). ``attention="split"`` runs the two parts of the mask
as two flash-attention calls, the suffix over the prefix with no mask and the suffix over itself
with the square causal mask, and merges them by their log-sum-exps: the kernels of a full prefill,
none with a mask to read.

Tensor parallelism (:class:`TensorParallel`): a rank holds its share of the query heads, of the
KV heads (with their query groups) and of the MLP's width, so its KV cache holds its heads only;
the attention's output projection and the MLP's down projection give partial sums, added over the
group (Megatron's split). The weights are drawn whole and sliced, so any group computes the model
one process computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F

from tutti_cluster.bench.kvdata import KVShape
from tutti_cluster.errors import ConfigError
from tutti_cluster.pipeline.hooks import LayerHooks

Attention = Literal["auto", "flex", "sdpa", "split"]
ATTENTION_CHOICES = ("auto", "flex", "sdpa", "split")
FLEX_BLOCK = 128  # flex_attention's default tile, query and key alike


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape (grouped-query attention, SwiGLU MLP, RoPE) and its KV paging."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0
    block_tokens: int = 16

    def __post_init__(self) -> None:
        for f in ("layers", "q_heads", "kv_heads", "head_dim", "hidden", "ffn", "vocab", "block_tokens"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"model shape {self.name!r}: {f} must be positive")
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"model shape {self.name!r}: q_heads ({self.q_heads}) must be a multiple of "
                              f"kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model shape {self.name!r}: head_dim must be even (rotary embedding)")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over every layer (bf16), K and V."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    def kv_shape(self) -> KVShape:
        """The benchmark's KV-shape record of this model (bf16)."""
        return KVShape(layers=self.layers, kv_heads=self.kv_heads, head_size=self.head_dim,
                       block_tokens=self.block_tokens, dtype=torch.bfloat16)

    def shard(self, tp: int) -> ModelShape:
        """One rank's share of the model under ``tp``-way tensor parallelism (Megatron's split: each
        rank holds ``1/tp`` of the query and KV heads and of the MLP's width)."""
        if tp < 1:
            raise ConfigError("tensor parallelism must be at least 1")
        if tp == 1:
            return self
        for f in ("q_heads", "kv_heads", "ffn"):
            if getattr(self, f) % tp:
                raise ConfigError(f"model shape {self.name!r}: {f} ({getattr(self, f)}) is not divisible by "
                                  f"the tensor-parallel size {tp}")
        return replace(self, name=f"{self.name}/tp{tp}", q_heads=self.q_heads // tp, kv_heads=self.kv_heads // tp,
                       ffn=self.ffn // tp)

    def key(self) -> str:
        """A text naming every field that changes per-layer compute (profile files are keyed by it)."""
        return (f"{self.name}:L{self.layers}:q{self.q_heads}:kv{self.kv_heads}:d{self.head_dim}:h{self.hidden}"
                f":f{self.ffn}")


SHAPES: dict[str, ModelShape] = {
    "llama3-8b": ModelShape("llama3-8b", layers=32, q_heads=32, kv_heads=8, head_dim=128, hidden=4096,
                            ffn=14336, vocab=128256, rope_theta=500000.0),
    # GLM-4-9B-Chat-1M: 2 KV groups (multi-query in pairs), about 40 KB of KV per token.
    "glm4-9b-1m": ModelShape("glm4-9b-1m", layers=40, q_heads=32, kv_heads=2, head_dim=128, hidden=4096,
                             ffn=13696, vocab=151552, rope_theta=10000.0 * 500),
    # For CPU tests: every code path, a fraction of a second per prefill.
    "tiny": ModelShape("tiny", layers=4, q_heads=4, kv_heads=2, head_dim=32, hidden=128, ffn=256, vocab=512,
                       rope_theta=10000.0),
}


def model_shape(name: str, layers: int | None = None) -> ModelShape:
    """A shape of :data:`SHAPES` by name, optionally with fewer (or more) layers."""
    if name not in SHAPES:
        raise ConfigError(f"unknown model shape {name!r}; choose from {', '.join(SHAPES)}")
    s = SHAPES[name]
    return replace(s, layers=layers) if layers is not None else s


class PagedKV:
    """The paged KV cache of every layer: ``all[l, kv, block, token, head, dim]`` (bf16)."""

    def __init__(self, shape: ModelShape, num_blocks: int, device: torch.device) -> None:
        if num_blocks <= 0:
            raise ConfigError("a KV cache needs at least one block")
        self.model = shape
        self.shape = shape.kv_shape()
        self.device = device
        self.max_blocks = num_blocks
        self.all = torch.zeros((shape.layers, 2, num_blocks, shape.block_tokens, shape.kv_heads, shape.head_dim),
                               dtype=torch.bfloat16, device=device)
        self.layers: list[torch.Tensor] = [self.all[l] for l in range(shape.layers)]

    @property
    def nbytes(self) -> int:
        return self.all.numel() * self.all.element_size()

    def randomize(self, block_ids: torch.Tensor, seed: int) -> None:
        """Seeded random KV (unit variance, bf16) in blocks ``block_ids`` of every layer: a stand-in
        for a computed prefix when only timing matters (a 640K-token prefix takes minutes to compute)."""
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        ids = block_ids.to(self.device)
        for l in range(self.model.layers):
            x = torch.randn((2, ids.numel(), *self.all.shape[3:]), generator=g, device=self.device,
                            dtype=torch.bfloat16)
            self.all[l].index_copy_(1, ids, x)

    def fill(self, block_ids: torch.Tensor, value: float) -> None:
        """Overwrite blocks ``block_ids`` of every layer, K and V (NaN marks KV not restored)."""
        ids = block_ids.to(self.device)
        self.all.index_fill_(2, ids, value)


@dataclass
class PrefillOutput:
    hidden: torch.Tensor  # last token's final hidden state (bf16, [hidden])
    logits: torch.Tensor  # last token's logits (float32, [vocab])


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group and the group's sum (``all_reduce`` adds a
    tensor over the ranks in place, e.g. ``torch.distributed.all_reduce``)."""

    rank: int
    size: int
    all_reduce: Callable[[torch.Tensor], None]

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor-parallel rank {self.rank} outside a group of {self.size}")


class _Weights:
    """The whole model's seeded weights, or one tensor-parallel rank's slices of them (drawn whole,
    layer by layer, and sliced: every group size computes the same model)."""

    def __init__(self, shape: ModelShape, device: torch.device, seed: int, rank: int = 0, size: int = 1) -> None:
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        dt = torch.bfloat16
        local = shape.shard(size)

        def rand(*dims: int, scale: float) -> torch.Tensor:
            w = torch.randn(dims, generator=g, device=device, dtype=dt)
            return w.mul_(scale)

        def part(w: torch.Tensor, dim: int, start: int, width: int) -> torch.Tensor:
            return w.narrow(dim, start + rank * width, width)

        h, qd, kvd = shape.hidden, shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim
        lqd, lkvd, lffn = local.q_heads * shape.head_dim, local.kv_heads * shape.head_dim, local.ffn
        self.embed = rand(shape.vocab, h, scale=1.0)  # tied with the output projection; every rank's
        self.layers = []
        for _ in range(shape.layers):
            wqkv = rand(h, qd + 2 * kvd, scale=1 / math.sqrt(h))
            wo = rand(qd, h, scale=1 / math.sqrt(qd))
            w_gate_up = rand(h, 2 * shape.ffn, scale=1 / math.sqrt(h))
            w_down = rand(shape.ffn, h, scale=1 / math.sqrt(shape.ffn))
            if size > 1:  # a rank's query heads, its KV heads (their groups) and its share of the MLP
                wqkv = torch.cat((part(wqkv, 1, 0, lqd), part(wqkv, 1, qd, lkvd), part(wqkv, 1, qd + kvd, lkvd)), 1)
                wo = part(wo, 0, 0, lqd).contiguous()
                w_gate_up = torch.cat((part(w_gate_up, 1, 0, lffn), part(w_gate_up, 1, shape.ffn, lffn)), 1)
                w_down = part(w_down, 0, 0, lffn).contiguous()
            self.layers.append({
                "attn_norm": torch.ones(h, device=device, dtype=dt),
                "wqkv": wqkv,
                "wo": wo,
                "mlp_norm": torch.ones(h, device=device, dtype=dt),
                "w_gate_up": w_gate_up,
                "w_down": w_down,
            })
        self.final_norm = torch.ones(h, device=device, dtype=dt)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def lower_right_block_mask(q_len: int, kv_len: int, device: torch.device, block: int = FLEX_BLOCK) -> Any:
    """flex_attention's BlockMask for the lower-right causal mask, built from block indices.

    Query ``i`` (of ``q_len``) sees keys ``0 .. kv_len - q_len + i``. For query tile ``t`` the key
    tiles entirely at or left of its first row are *full* (no mask_mod call), those up to its last row
    *partial*; the index tensors are ``[1, 1, q_tiles, kv_tiles]`` int32, so the mask costs
    ``q_tiles x kv_tiles x 4`` bytes twice (4 MiB at 128K tokens), never ``q_len x kv_len``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if not 0 < q_len <= kv_len:
        raise ConfigError(f"attention of {q_len} queries over {kv_len} keys: need 0 < queries <= keys")
    offset = kv_len - q_len
    nq, nk = -(-q_len // block), -(-kv_len // block)
    t = torch.arange(nq, device=device, dtype=torch.int64)
    first_row = t * block + offset
    last_row = torch.clamp((t + 1) * block, max=q_len) - 1 + offset
    full = torch.clamp((first_row + 1) // block, max=nk)
    touched = torch.clamp(last_row // block + 1, max=nk)
    partial = touched - full
    cols = torch.arange(nk, device=device, dtype=torch.int64)
    # Partial tiles of row t are full[t] .. touched[t]-1; entries past a row's count are ignored
    # (kept in range for safety).
    kv_indices = ((full[:, None] + cols[None, :]) % nk).to(torch.int32)
    full_indices = cols.to(torch.int32).expand(nq, nk).contiguous()
    off = torch.tensor(offset, device=device, dtype=torch.int64)

    def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return q + off >= kv

    return BlockMask.from_kv_blocks(
        partial.to(torch.int32)[None, None], kv_indices[None, None],
        full.to(torch.int32)[None, None], full_indices[None, None],
        BLOCK_SIZE=block, mask_mod=causal, seq_lengths=(q_len, kv_len),
    )


_compiled_flex: dict[bool | None, Callable[..., Any]] = {}


def _flex(dynamic: bool | None) -> Callable[..., Any]:
    """flex_attention compiled once per process and mode (uncompiled it materialises the scores).

    ``dynamic=False`` compiles each (queries, keys) shape on its own; ``None`` is torch's default,
    which recompiles once with symbolic lengths when a second shape arrives (fewer compiles).
    """
    fn = _compiled_flex.get(dynamic)
    if fn is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(256, getattr(torch._dynamo.config, knob)))
        fn = _compiled_flex[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return fn


_masks: dict[tuple[int, int, str], Any] = {}


def cached_block_mask(q_len: int, kv_len: int, device: torch.device) -> Any:
    """:func:`lower_right_block_mask`, built once per shape (the same mask object on every layer and
    run, so a compiled kernel sees the same inputs)."""
    key = (q_len, kv_len, str(device))
    m = _masks.get(key)
    if m is None:
        if len(_masks) > 64:
            _masks.clear()
        m = _masks[key] = lower_right_block_mask(q_len, kv_len, device)
    return m


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str, compiled: bool = True,
              dynamic: bool | None = None) -> torch.Tensor:
    """Lower-right causal grouped-query attention. ``q``: [queries, q_heads, d]; ``k``, ``v``:
    [keys, kv_heads, d]. Returns [queries, q_heads, d]."""
    if kind == "split":
        return split_attention(q, k, v)
    s, n = q.shape[0], k.shape[0]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if kind == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        mask = cached_block_mask(s, n, q.device)
        fn: Callable[..., Any] = _flex(dynamic) if compiled else flex_attention  # type: ignore[assignment]
        out = fn(qh, kh, vh, block_mask=mask, enable_gqa=True)
    else:
        if s == n:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        else:
            from torch.nn.attention.bias import causal_lower_right

            groups = q.shape[1] // k.shape[1]
            # CausalBias goes through its own dispatch, which does not take enable_gqa everywhere.
            kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(s, n))
    return out.squeeze(0).transpose(0, 1)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention's output and log-sum-exp (natural log, float32), ``[1, heads, len, d]`` in,
    ``[1, heads, len]`` log-sum-exp out; equal head counts."""
    if q.device.type == "cuda":
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out[0], out[1]


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Lower-right causal grouped-query attention as two unmasked-or-square-causal parts: the
    ``s`` queries over the ``n - s`` prefix keys (all visible; each KV head's query group is one
    longer sequence, so the prefix's K and V are not repeated) and over their own ``s`` keys (causal),
    merged by log-sum-exp. Same arguments and result as :func:`attention`."""
    s, n = q.shape[0], k.shape[0]
    qheads, kheads, d = q.shape[1], k.shape[1], q.shape[2]
    g = qheads // kheads
    kh, vh = (x[n - s :].transpose(0, 1).unsqueeze(0).repeat_interleave(g, dim=1) for x in (k, v))
    own, own_lse = _flash(q.transpose(0, 1).unsqueeze(0), kh, vh, True)
    if s == n:
        return own.squeeze(0).transpose(0, 1)
    # [s, kheads * g, d] -> [1, kheads, s * g, d]: query (i, head kh * g + j) at row i * g + j.
    qg = q.reshape(s, kheads, g, d).transpose(0, 1).reshape(1, kheads, s * g, d)
    kp, vp = (x[: n - s].transpose(0, 1).unsqueeze(0) for x in (k, v))
    pre, pre_lse = _flash(qg, kp, vp, False)
    pre = pre.reshape(kheads, s, g, d).permute(0, 2, 1, 3).reshape(1, qheads, s, d)
    pre_lse = pre_lse.reshape(kheads, s, g).permute(0, 2, 1).reshape(1, qheads, s)
    lse = torch.logaddexp(pre_lse, own_lse)
    out = pre.float() * (pre_lse - lse).exp().unsqueeze(-1) + own.float() * (own_lse - lse).exp().unsqueeze(-1)
    return out.to(q.dtype).squeeze(0).transpose(0, 1)


def _is_range(block_ids: torch.Tensor) -> bool:
    """Whether a block table is consecutive blocks (then a layer's KV is a view, not a copy)."""
    lo = int(block_ids[0])
    return bool((block_ids.cpu() == torch.arange(lo, lo + block_ids.numel())).all())


def _gather(cache: torch.Tensor, ids: torch.Tensor, contiguous: bool, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` tokens' K and V of one layer's paged cache, in block-table order."""
    heads, dim = cache.shape[-2], cache.shape[-1]
    if contiguous:
        lo = int(ids[0])
        k = cache[0, lo : lo + ids.numel()].reshape(-1, heads, dim)
        v = cache[1, lo : lo + ids.numel()].reshape(-1, heads, dim)
    else:
        k = cache[0].index_select(0, ids).view(-1, heads, dim)
        v = cache[1].index_select(0, ids).view(-1, heads, dim)
    return k[:n], v[:n]


class Decoder:
    """The model: weights, RoPE tables, and a prefill of the uncached suffix over a paged cache."""

    def __init__(self, shape: ModelShape, device: torch.device, *, seed: int = 0, attention: str = "auto",
                 mlp_chunk_tokens: int = 16384, flex_dynamic: bool | None = None,
                 tp: TensorParallel | None = None) -> None:
        if attention not in ATTENTION_CHOICES:
            raise ConfigError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, not {attention!r}")
        if mlp_chunk_tokens <= 0:
            raise ConfigError("mlp_chunk_tokens must be positive")
        # Under tensor parallelism ``shape`` is this rank's share (its heads, its KV cache, its MLP
        # width) and the attention's and the MLP's outputs are summed over the group.
        self.full_shape = shape
        self.shape = shape.shard(tp.size) if tp else shape
        self.tp = tp
        self.device = device
        self.attention = attention
        self.mlp_chunk_tokens = mlp_chunk_tokens
        self.flex_dynamic = flex_dynamic
        self.w = _Weights(shape, device, seed, tp.rank, tp.size) if tp else _Weights(shape, device, seed)
        half = shape.head_dim // 2
        self._inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))

    def attention_kind(self, queries: int, keys: int) -> str:
        """Which kernel runs a layer of ``queries`` over ``keys``: flex for a cached prefix on CUDA,
        SDPA's causal kernel with none (faster there), SDPA on the CPU."""
        if self.attention != "auto":
            return self.attention
        return "flex" if self.device.type == "cuda" and queries < keys else "sdpa"

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ang = pos.float()[:, None] * self._inv_freq[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the tensor-parallel group of a row-parallel projection's partial output."""
        if self.tp is not None:
            self.tp.all_reduce(x)
        return x

    def _mlp(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.empty_like(x)
        for i in range(0, x.shape[0], self.mlp_chunk_tokens):
            h = _rms_norm(x[i : i + self.mlp_chunk_tokens], w["mlp_norm"])
            gate, up = (h @ w["w_gate_up"]).chunk(2, dim=-1)
            out[i : i + self.mlp_chunk_tokens] = (F.silu(gate) * up) @ w["w_down"]
        return self._reduce(out)

    def check(self, kv: PagedKV, tokens: torch.Tensor, prefix: int, block_ids: torch.Tensor) -> None:
        """Raises ConfigError when a prefill of these arguments cannot run."""
        s = self.shape
        n = int(tokens.numel())
        bt = s.block_tokens
        if kv.model != s:
            raise ConfigError("the KV cache was made for another model shape")
        if n <= 0 or n % bt:
            raise ConfigError(f"input of {n} tokens: must be a positive multiple of the block size ({bt})")
        if not 0 <= prefix < n or prefix % bt:
            raise ConfigError(f"prefix of {prefix} tokens: must be a multiple of {bt} in [0, {n}) for an input "
                              f"of {n} tokens (at least one token is computed)")
        if block_ids.numel() != n // bt:
            raise ConfigError(f"the block table has {block_ids.numel()} blocks, the input needs {n // bt}")
        if int(block_ids.max()) >= kv.max_blocks or int(block_ids.min()) < 0:
            raise ConfigError(f"block ids must lie in [0, {kv.max_blocks})")

    @torch.inference_mode()
    def prefill(self, kv: PagedKV, tokens: torch.Tensor, prefix: int, block_ids: torch.Tensor,
                hooks: LayerHooks | None = None, layers: int | None = None) -> PrefillOutput:
        """Prefill of ``tokens[prefix:]`` with the KV of ``tokens[:prefix]`` in (or arriving in) blocks
        ``block_ids[:prefix // block_tokens]``; writes the suffix's KV into the rest of ``block_ids``.
        ``layers`` runs only the first layers (compile warm-up)."""
        self.check(kv, tokens, prefix, block_ids)
        s = self.shape
        hooks = hooks or LayerHooks()
        n = int(tokens.numel())
        bt = s.block_tokens
        ids = block_ids.to(self.device)
        contiguous = _is_range(block_ids)
        suffix_ids = ids[prefix // bt :]
        x = self.w.embed[tokens[prefix:].to(self.device)]
        pos = torch.arange(prefix, n, device=self.device)
        qd, kvd = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        kind = self.attention_kind(n - prefix, n)
        for l in range(s.layers if layers is None else layers):
            w = self.w.layers[l]
            hooks.before_layer(l)
            h = _rms_norm(x, w["attn_norm"])
            q, k, v = (h @ w["wqkv"]).split((qd, kvd, kvd), dim=-1)
            q = self._rope(q.view(-1, s.q_heads, s.head_dim), pos)
            k = self._rope(k.view(-1, s.kv_heads, s.head_dim), pos)
            v = v.reshape(-1, s.kv_heads, s.head_dim)
            cache = kv.all[l]
            cache[0].index_copy_(0, suffix_ids, k.view(-1, bt, s.kv_heads, s.head_dim))
            cache[1].index_copy_(0, suffix_ids, v.view(-1, bt, s.kv_heads, s.head_dim))
            hooks.before_attention(l)
            kk, vv = _gather(cache, ids, contiguous, n)
            a = attention(q, kk, vv, kind, dynamic=self.flex_dynamic)
            x = x + self._reduce(a.reshape(-1, qd) @ w["wo"])
            x = x + self._mlp(x, w)
            hooks.after_layer(l)
        last = _rms_norm(x[-1:], self.w.final_norm)[0]
        logits = last.float() @ self.w.embed.float().T
        return PrefillOutput(hidden=last, logits=logits)

    @torch.inference_mode()
    def decode_step(self, kv: PagedKV, token: int, position: int, block_ids: torch.Tensor,
                    hooks: LayerHooks | None = None) -> PrefillOutput:
        """One generated token at ``position`` (its KV goes into the block table's block for it)."""
        s = self.shape
        hooks = hooks or LayerHooks()
        bt = s.block_tokens
        if not 0 <= position < block_ids.numel() * bt:
            raise ConfigError(f"position {position} is outside the block table ({block_ids.numel()} blocks)")
        used = block_ids[: position // bt + 1]
        ids = used.to(self.device)
        contiguous = _is_range(used)
        blk, off = int(block_ids[position // bt]), position % bt
        x = self.w.embed[torch.tensor([token], device=self.device)]
        pos = torch.tensor([position], device=self.device)
        qd, kvd = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        n = position + 1
        for l in range(s.layers):
            w = self.w.layers[l]
            hooks.before_layer(l)
            h = _rms_norm(x, w["attn_norm"])
            q, k, v = (h @ w["wqkv"]).split((qd, kvd, kvd), dim=-1)
            q = self._rope(q.view(1, s.q_heads, s.head_dim), pos)
            k = self._rope(k.view(1, s.kv_heads, s.head_dim), pos)
            cache = kv.all[l]
            cache[0, blk, off] = k[0]
            cache[1, blk, off] = v.view(s.kv_heads, s.head_dim)
            hooks.before_attention(l)
            kk, vv = _gather(cache, ids, contiguous, n)
            qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, kk, vv))
            a = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True).squeeze(0).transpose(0, 1)
            x = x + self._reduce(a.reshape(1, qd) @ w["wo"])
            x = x + self._mlp(x, w)
            hooks.after_layer(l)
        last = _rms_norm(x, self.w.final_norm)[0]
        return PrefillOutput(hidden=last, logits=last.float() @ self.w.embed.float().T)

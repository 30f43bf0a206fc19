"""Cache-unit keys: 64-bit integers in the native core.

A key names one cache unit of one prefix. Callers pass what their engine computes (vLLM's block hashes
are ``bytes``; LMCache-style chain hashes are ``int``); both map deterministically onto 64 bits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from tutti_cluster.errors import LayoutError

Key = int | bytes
_MASK = (1 << 64) - 1


def to_key(k: Key) -> int:
    """Maps an engine key onto the store's 64-bit key."""
    if isinstance(k, bool):
        raise LayoutError("a key must be int or bytes, not bool")
    if isinstance(k, (int, np.integer)):
        return int(k) & _MASK
    if isinstance(k, (bytes, bytearray, memoryview)):
        return int.from_bytes(hashlib.blake2b(bytes(k), digest_size=8).digest(), "little")
    raise LayoutError(f"a key must be int or bytes, not {type(k).__name__}")


def key_array(keys: Iterable[Key]) -> np.ndarray:
    """Keys as a contiguous uint64 array for the native core."""
    return np.fromiter((to_key(k) for k in keys), dtype=np.uint64)


def chain_keys(tokens: Sequence[int], unit_tokens: int, namespace: bytes = b"") -> list[int]:
    """Prefix-chain keys of the full units of ``tokens``: key i covers tokens[: (i + 1) * unit_tokens].

    Each key hashes the previous key and the unit's tokens, as vLLM and LMCache chain their hashes.
    """
    out: list[int] = []
    prev = hashlib.blake2b(namespace, digest_size=8).digest()
    for start in range(0, len(tokens) - unit_tokens + 1, unit_tokens):
        h = hashlib.blake2b(prev, digest_size=8)
        h.update(np.asarray(tokens[start : start + unit_tokens], dtype=np.int64).tobytes())
        prev = h.digest()
        out.append(int.from_bytes(prev, "little"))
    return out

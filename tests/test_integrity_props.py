"""Property tests of issue 13 (hypothesis): wrong KV is never served.

- Random errors of 1 to 3 bits, and bursts of up to 32 bits, in any object of a stored unit (live,
  or with the store reopened) always make the unit a miss.
- The same errors in a header always leave the unit absent, counted in ``bad_headers``, and never
  make another unit appear or the instance fail.
- Random call sequences and argument values against the native API (a rule-based state machine over
  begin/layer/wait/finish and get_iocb/fill_iocb/issue_io/wait_cqe/put_iocb) never crash and never
  finish with a unit reported loaded over wrong bytes.

Each property runs in a child process (``python tests/test_integrity_props.py NAME``): a crash in
native code then fails its test, with the last calls made, instead of killing pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from conftest import UNIT_TOKENS, make_kv, open_store, snapshot, zero
from test_integrity import find_slots, flip_bits, header_format, header_slots, object_offset, unit_bytes_equal
from tutti_cluster import TuttiConfig, TuttiStore
from tutti_cluster.errors import NotFound, TuttiError

HERE = Path(__file__).resolve().parent
NEVER_STORED = object()
PROPERTY_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck),
                         report_multiple_bugs=False)


def error_pattern(span_bits: int) -> st.SearchStrategy[list[int]]:
    """Bit positions in [0, span_bits) to flip: 1-3 distinct bits; the same bit of two 32-bit words
    (high bits drawn often: where sums of words alias); or a burst of up to 32 bits (first and last
    bit set)."""
    words = span_bits // 32
    word_bit = st.one_of(st.just(31), st.integers(0, 31))
    bit = st.tuples(st.integers(0, words - 1), word_bit).map(lambda t: t[0] * 32 + t[1])
    few = st.lists(bit, min_size=1, max_size=3, unique=True)
    pair = st.tuples(st.lists(st.integers(0, words - 1), min_size=2, max_size=2, unique=True),
                     st.one_of(st.just(31), st.integers(24, 31))).map(lambda t: sorted(w * 32 + t[1] for w in t[0]))

    @st.composite
    def burst(draw) -> list[int]:
        n = draw(st.integers(1, 32))
        start = draw(st.integers(0, span_bits - n))
        inner = draw(st.lists(st.booleans(), min_size=max(0, n - 2), max_size=max(0, n - 2)))
        return sorted({start, start + n - 1} | {start + 1 + i for i, on in enumerate(inner) if on})

    return st.one_of(few, pair, burst())


# ---- objects ---------------------------------------------------------------------------------
def prop_object_errors_are_misses() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _object_errors_are_misses(Path(tmp))


def _object_errors_are_misses(tmp: Path) -> None:
    dirs = [tmp / "a", tmp / "b"]
    for d in dirs:
        d.mkdir()
    kv = make_kv(seed=201)
    state = {"s": open_store(dirs, kv), "key": 1000}
    g = state["s"].geometry()
    ub = g["unit_blocks"]
    payload_bits = ub * g["block_bytes"] * 8
    control = 1
    assert state["s"].store([control], np.arange(ub)).ok
    want = snapshot(kv)

    @settings(max_examples=40, **PROPERTY_SETTINGS)
    @given(obj=st.integers(0, g["num_layers"] * g["objs_per_layer"] - 1), bits=error_pattern(payload_bits),
           reopen=st.booleans())
    def check(obj: int, bits: list[int], reopen: bool) -> None:
        s = state["s"]
        state["key"] += 1
        key = state["key"]
        assert s.store([key], np.arange(ub) + 8).ok
        f, off = find_slots(dirs)[key]
        layer, o = divmod(obj, g["objs_per_layer"])
        flip_bits(f, off + object_offset(g, layer, o), bits)
        note(f"unit {key}: flipped bits {bits} of layer {layer} object {o}")
        if reopen:
            s.close()
            s = state["s"] = open_store(dirs, kv)
        with pytest.raises(NotFound):
            s.read_unit(key)
        res = s.retrieve([key], np.arange(ub) + 48)
        assert res.failed_units == [0], f"a corrupt object was served: {res}"
        assert s.lookup([key]) == 0
        res = s.retrieve([control], np.arange(ub) + 48)  # the rest of the instance is untouched
        assert res.ok and unit_bytes_equal(want, np.arange(ub), kv, np.arange(ub) + 48)

    try:
        check()
    finally:
        state["s"].close()


# ---- headers ---------------------------------------------------------------------------------
def prop_header_errors_are_absent_units() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _header_errors_are_absent_units(Path(tmp))


def _header_errors_are_absent_units(tmp: Path) -> None:
    dirs = [tmp / "a", tmp / "b"]
    for d in dirs:
        d.mkdir()
    kv = make_kv(seed=202)
    w = open_store(dirs, kv)
    g = w.geometry()
    ub = g["unit_blocks"]
    _, fields, fixed = header_format()
    magic_bits = 64
    # The verified part of a header: the fixed fields and the list of object checksums after them.
    checked_bits = (fixed + 8 * g["num_layers"] * g["objs_per_layer"]) * 8
    control = [1, 2, 3]
    assert w.store(control, np.arange(3 * ub)).ok
    state = {"key": 1000, "bad": 0, "bad_magic": 0}

    @settings(max_examples=40, **PROPERTY_SETTINGS)
    @given(bits=error_pattern(checked_bits))
    def check(bits: list[int]) -> None:
        state["key"] += 1
        key = state["key"]
        before = header_slots(dirs)
        assert w.store([key], np.arange(ub) + 12).ok
        # The slot this store wrote: an earlier damaged header may read as this key now (a flipped
        # key bit), so match on the header bytes that changed, not on the key alone.
        (f, off), = [at for at, h in header_slots(dirs).items() if h != before.get(at)]
        assert find_slots(dirs).get(key) is not None
        flip_bits(f, off, bits)
        note(f"unit {key}: flipped header bits {bits}")
        if all(b < magic_bits for b in bits):
            state["bad_magic"] += 1
        else:
            state["bad"] += 1
        r = TuttiStore(TuttiConfig(paths=dirs, unit_tokens=UNIT_TOKENS))
        r.register_kv_caches(kv, block_tokens=16, read_only=True)  # never an instance-wide error
        try:
            assert r.lookup([key]) == 0
            assert sorted(r.keys()) == control, "a damaged header made a unit appear"
            bad = r.stats()["bad_headers"]
            assert state["bad"] <= bad <= state["bad"] + state["bad_magic"], (bad, state)
            with pytest.raises(NotFound):
                r.read_unit(key)
        finally:
            r.close()

    try:
        check()
    finally:
        w.close()


# ---- the native API --------------------------------------------------------------------------
class NativeApiMachine(RuleBasedStateMachine):
    """Random calls and arguments against one store (4 layers, 8 IOCBs, 4 blocks per unit).

    Blocks 0-47 are the stores' sources (areas of 8 blocks, one request each), 48-95 the retrieves'
    destinations (likewise), so each request's expected bytes are known. A request against which an
    IOCB of the other direction was issued (a write into a retrieve, a read into a store) moves bytes
    the caller asked for: its own bytes are not checked, and the units it touched may become misses.
    """

    AREAS = 6  # of 8 blocks: up to 2 units

    def __init__(self) -> None:
        super().__init__()
        self._tmp = tempfile.TemporaryDirectory()
        tmp = Path(self._tmp.name)
        self.dirs = [tmp / "a", tmp / "b"]
        for d in self.dirs:
            d.mkdir()
        self.kv = make_kv(seed=203)
        self.s = open_store(self.dirs, self.kv, iocb_depth=8)
        self.layers = self.s.num_layers
        self.ub = self.s.unit_blocks
        # key -> {"content": per-layer arrays (None: unknown), "suspect": may be a miss (an IOCB wrote into
        # its slot, or a retrieve of it failed and dropped it)}
        self.stored: dict[int, dict] = {}
        self.reqs: dict[int, dict] = {}
        self.free_src = list(range(self.AREAS))
        self.free_dst = list(range(self.AREAS))
        self.held: set[int] = set()  # taken with get_iocb, not put back
        self.filled: dict[int, tuple[int, str]] = {}  # iocb -> (request, op) of its last fill
        self.in_flight: set[int] = set()
        self.next_key = 1
        # Two committed units to read back.
        for _ in range(2):
            self._store_now([self._new_key()])

    # helpers
    def _log(self, what: str) -> None:
        print(what, flush=True)
        note(what)

    def _new_key(self) -> int:
        self.next_key += 1
        return self.next_key

    def _blocks(self, area: int, n: int, base: int) -> np.ndarray:
        return np.arange(base + area * 8, base + area * 8 + n * self.ub)

    def _content(self, blocks: np.ndarray, u: int) -> list:
        b = blocks[u * self.ub : (u + 1) * self.ub]
        return [l[:, b].copy() for l in self.kv]

    def _store_now(self, keys: list[int]) -> None:
        blocks = self._blocks(0, len(keys), 0)
        assert self.s.store(keys, blocks).ok
        for u, k in enumerate(keys):
            self.stored[k] = {"content": self._content(blocks, u), "suspect": False}

    def _call(self, what: str, fn):
        self._log(what)
        try:
            return True, fn()
        except TuttiError as e:
            self._log(f"  -> {type(e).__name__}: {e}")
            return False, None

    def _any_req(self, data) -> int:
        live = sorted(self.reqs)
        choices = [st.sampled_from([-1, 10**6, 255, 7])]
        if live:
            choices.insert(0, st.sampled_from(live))
        return data.draw(st.one_of(*choices), label="request")

    def _any_iocb(self, data) -> int:
        choices = [st.integers(-1, 9), st.just(10**6)]
        if self.held:
            choices.insert(0, st.sampled_from(sorted(self.held)))
        return data.draw(st.one_of(*choices), label="iocb")

    # rules: requests
    @precondition(lambda self: self.free_dst)
    @rule(data=st.data(), n=st.integers(1, 2))
    def begin_retrieve(self, data, n: int) -> None:
        pool = sorted(self.stored) + [999_999]
        keys = data.draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n), label="keys")
        area = self.free_dst[0]
        blocks = self._blocks(area, n, 48)
        ok, req = self._call(f"begin_retrieve({keys}, area {area})", lambda: self.s.begin_retrieve(keys, blocks))
        if ok:
            self.free_dst.pop(0)
            self.reqs[req] = {"op": "read", "keys": keys, "blocks": blocks, "area": area, "raw": set(),
                              "tainted": False,
                              "want": {u: (self.stored[k]["content"] if k in self.stored else NEVER_STORED)
                                       for u, k in enumerate(keys)}}

    @precondition(lambda self: self.free_src)
    @rule(data=st.data(), n=st.integers(1, 2))
    def begin_store(self, data, n: int) -> None:
        keys = []
        for _ in range(n):  # mostly new keys; an old one is skipped (already stored)
            old = self.stored and data.draw(st.booleans(), label="old key")
            keys.append(data.draw(st.sampled_from(sorted(self.stored)), label="key") if old else self._new_key())
        area = self.free_src[0]
        blocks = self._blocks(area, n, 0)
        ok, req = self._call(f"begin_store({keys}, area {area})", lambda: self.s.begin_store(keys, blocks))
        if ok:
            self.free_src.pop(0)
            self.reqs[req] = {"op": "write", "keys": keys, "blocks": blocks, "area": area, "raw": set(),
                              "tainted": False, "want": {u: self._content(blocks, u) for u in range(n)}}

    @rule(data=st.data())
    def layer(self, data) -> None:
        req = self._any_req(data)
        layer = data.draw(st.one_of(st.integers(0, self.layers - 1), st.sampled_from([-1, self.layers, 999])), label="layer")
        if req in self.reqs and self.reqs[req]["op"] == "write":
            self._call(f"store_layer({layer}, {req})", lambda: self.s.store_layer(layer, req))
        else:
            self._call(f"retrieve_layer({layer}, {req})", lambda: self.s.retrieve_layer(layer, req))

    @rule(data=st.data())
    def wait_layer(self, data) -> None:
        req = self._any_req(data)
        layer = data.draw(st.one_of(st.integers(0, self.layers - 1), st.sampled_from([-1, 999])), label="layer")
        self._call(f"wait_layer({layer}, {req})", lambda: self.s.wait_layer(layer, req))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data) -> None:
        self._finish(data.draw(st.sampled_from(sorted(self.reqs)), label="request"))

    @rule(req=st.sampled_from([-1, 10**6, 200]))
    def finish_unknown(self, req: int) -> None:
        self._call(f"finish({req})", lambda: self.s.finish(req))

    def _finish(self, req: int) -> None:
        r = self.reqs[req]
        for i in sorted(r["raw"] & self.in_flight):  # a caller waits for the IOCBs it issued
            self._call(f"wait_cqe({i})", lambda: self.s.wait_cqe(i))
            self.in_flight.discard(i)
        ok, res = self._call(f"finish({req})", lambda: self.s.finish(req))
        assert ok, f"finish of a live request {req} raised"
        self._log(f"  -> {res}")
        del self.reqs[req]
        for i, (fr, _) in list(self.filled.items()):
            if fr == req:
                del self.filled[i]
        if r["op"] == "read":
            self.free_dst.append(r["area"])
            if r["tainted"]:
                return
            for u, k in enumerate(r["keys"]):
                if u in res.failed_units:
                    if k in self.stored:  # a failed unit may have been dropped from the index
                        self.stored[k]["suspect"] = True
                    continue
                want = r["want"][u]
                assert want is not NEVER_STORED, f"unit {u} (key {k}) was never stored yet reported loaded: {res}"
                if want is None:
                    continue  # stored by a request whose own bytes were not known
                got = [l[:, r["blocks"][u * self.ub : (u + 1) * self.ub]] for l in self.kv]
                for layer, (a, b) in enumerate(zip(want, got)):
                    assert np.array_equal(a, b), f"unit {u} (key {k}) reported loaded with wrong bytes in layer {layer}: {res}"
        else:
            self.free_src.append(r["area"])
            for u in res.committed_units:
                k = r["keys"][u]
                self.stored[k] = {"content": None if r["tainted"] else r["want"][u], "suspect": r["tainted"]}

    # rules: gio_uring
    @rule(n=st.one_of(st.integers(-1, 9), st.just(10**6)))
    def get_iocb(self, n: int) -> None:
        ok, ids = self._call(f"get_iocb({n})", lambda: self.s.get_iocb(n))
        if ok:
            assert len(set(ids)) == len(ids) and not (set(ids) & self.held), f"get_iocb handed out {ids} (held {self.held})"
            self.held |= set(ids)

    @rule(data=st.data(), op=st.sampled_from(["read", "write"]))
    def fill_iocb(self, data, op: str) -> None:
        i = self._any_iocb(data)
        req = self._any_req(data)
        layer = data.draw(st.one_of(st.integers(0, self.layers - 1), st.sampled_from([-1, 999])), label="layer")
        first = data.draw(st.one_of(st.integers(-1, 4), st.just(10**6)), label="first")
        count = data.draw(st.one_of(st.integers(-1, 5), st.just(2049)), label="count")
        ok, _ = self._call(f"fill_iocb({i}, op={op}, layer={layer}, req={req}, first={first}, count={count})",
                           lambda: self.s.fill_iocb(i, op=op, layer=layer, req=req, first=first, count=count))
        if ok:
            self.filled[i] = (req, op)

    @rule(data=st.data(), sms=st.sampled_from([0, 8, -1]))
    def issue_io(self, data, sms: int) -> None:
        ids = [self._any_iocb(data) for _ in range(data.draw(st.integers(1, 3), label="how many"))]
        ok, _ = self._call(f"issue_io({ids}, sms={sms})", lambda: self.s.issue_io(ids, sms=sms))
        if ok:
            for i in ids:
                self.in_flight.add(i)
                req, op = self.filled.get(i, (None, None))
                if req in self.reqs:
                    r = self.reqs[req]
                    r["raw"].add(i)
                    if op != r["op"]:
                        r["tainted"] = True
                        for k in r["keys"]:
                            if k in self.stored:
                                self.stored[k]["suspect"] = True

    @rule(data=st.data())
    def wait_cqe(self, data) -> None:
        i = self._any_iocb(data)
        ok, _ = self._call(f"wait_cqe({i})", lambda: self.s.wait_cqe(i))
        if ok:
            self.in_flight.discard(i)

    @rule(data=st.data())
    def put_iocb(self, data) -> None:
        i = self._any_iocb(data)
        ok, _ = self._call(f"put_iocb({i})", lambda: self.s.put_iocb(i))
        if ok:
            self.held.discard(i)

    @invariant()
    def alive(self) -> None:
        assert self.s.stats()["total_slots"] > 0

    def teardown(self) -> None:
        try:
            for req in sorted(self.reqs):
                self._finish(req)
            for i in sorted(self.in_flight & self.held):
                self._call(f"wait_cqe({i})", lambda: self.s.wait_cqe(i))
            for i in sorted(self.held):  # every IOCB back, so that the read-back below can begin
                self._call(f"put_iocb({i})", lambda: self.s.put_iocb(i))
            # Every committed unit reads back byte-exact (or, if an IOCB wrote into its slot, is a miss).
            for k, v in sorted(self.stored.items()):
                zero(self.kv)
                blocks = self._blocks(0, 1, 48)
                ok, res = self._call(f"retrieve([{k}])", lambda: self.s.retrieve([k], blocks))
                if not (ok and res.ok):
                    assert v["suspect"], f"committed unit {k} is lost: {res}"
                    continue
                if v["content"] is not None:
                    got = [l[:, blocks] for l in self.kv]
                    assert all(np.array_equal(a, b) for a, b in zip(v["content"], got)), f"unit {k} read back wrong"
        finally:
            self.s.close()
            self._tmp.cleanup()


def prop_native_api_state_machine() -> None:
    run_state_machine_as_test(NativeApiMachine, settings=settings(max_examples=30, stateful_step_count=30,
                                                                  **PROPERTY_SETTINGS))


PROPERTIES = {
    "objects": prop_object_errors_are_misses,
    "headers": prop_header_errors_are_absent_units,
    "native_api": prop_native_api_state_machine,
}


def _run_child(name: str) -> None:
    p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, name], capture_output=True, text=True,
                       timeout=420, cwd=HERE)
    seed = p.stdout.split("\n", 1)[0]
    assert p.returncode == 0, (f"property {name}: exit {p.returncode} ({seed})\n--- last calls:\n{p.stdout[-4000:]}\n"
                               f"--- stderr:\n{p.stderr[-8000:]}")


def test_object_bit_errors_and_bursts_are_always_misses():
    _run_child("objects")


def test_header_bit_errors_and_bursts_always_leave_the_unit_absent():
    _run_child("headers")


def test_native_api_random_calls_never_crash_nor_serve_wrong_bytes():
    _run_child("native_api")


if __name__ == "__main__":
    import random

    import hypothesis.core

    # A crash leaves hypothesis no chance to report its example: print the seed, so that
    # TUTTI_PROPERTY_SEED=<seed> python tests/test_integrity_props.py NAME replays the same run.
    seed = int(os.environ.get("TUTTI_PROPERTY_SEED") or random.randrange(1 << 32))
    print(f"hypothesis seed {seed}", flush=True)
    hypothesis.core.global_force_seed = seed
    PROPERTIES[sys.argv[1]]()

"""Wrong KV is never served (issue 13): one regression test per finding, on real pool files.

Findings 1-5 of the issue, each reproduced as it was found:
1. IOCBs running out mid-request, and `finish` of a request whose layers did not all move;
2. two-bit errors that the object and header checksums missed;
3. one flipped byte of a header's layout id refusing the whole instance;
4. the gio_uring API without bounds checks (run in a child process: a crash fails the test, it does
   not kill pytest);
5. the store not keeping the registered KV memory alive, and accepting unusable arrays.

Bytes are located from `native/src/header.h` (HeaderFixed) and `TuttiStore.geometry()`;
slots are found by scanning the pool files for the header magic, never by guessing offsets. The tests
depend on what the checksum detects, never on its values.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from conftest import BLOCKS, UNIT_TOKENS, make_kv, open_store, snapshot, zero
from tutti_cluster import TuttiConfig, TuttiStore, UnitFailure
from tutti_cluster.errors import CapacityExceeded, LayoutError, NotFound, TuttiError
from tutti_cluster.kv_layout import describe, layer_kv_from_tensor

ROOT = Path(__file__).resolve().parent.parent
HEADER_H = ROOT / "native" / "src" / "header.h"


# ---- locating bytes in the pool ---------------------------------------------------------------
@lru_cache(maxsize=1)
def header_format() -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """(magic bytes, {field: (offset, size)}, sizeof(HeaderFixed)) as header.h declares them."""
    text = HEADER_H.read_text()
    code = re.sub(r"//[^\n]*", "", text)
    magic = int(re.search(r"kHeaderMagic\s*=\s*(0x[0-9a-fA-F]+)", code).group(1), 16).to_bytes(8, "little")
    consts = {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr\s+\w+\s+(\w+)\s*=\s*(\d+)", code)}
    body = re.search(r"struct\s+HeaderFixed\s*\{(.*?)\};", code, re.S).group(1)
    sizes = {"uint64_t": 8, "int64_t": 8, "uint32_t": 4, "int32_t": 4, "uint16_t": 2, "uint8_t": 1, "char": 1}
    fields: dict[str, tuple[int, int]] = {}
    off = align = 0
    for m in re.finditer(r"(\w+)\s+(\w+)\s*(?:\[(\w+)\])?\s*;", body):
        es = sizes[m.group(1)]
        n = 1 if m.group(3) is None else (int(m.group(3)) if m.group(3).isdigit() else consts[m.group(3)])
        off = (off + es - 1) // es * es
        fields[m.group(2)] = (off, es * n)
        off += es * n
        align = max(align, es)
    return magic, fields, (off + align - 1) // align * align


def pool_files(dirs: list[Path], instance: str = "default") -> list[Path]:
    return sorted(p for d in dirs for p in Path(d).glob(f"tutti-{instance}*.pool"))


def header_slots(dirs: list[Path], instance: str = "default") -> dict[tuple[Path, int], bytes]:
    """{(pool file, offset): fixed part of the header} for every slot that starts with the header magic."""
    magic, _, fixed = header_format()
    out: dict[tuple[Path, int], bytes] = {}
    for f in pool_files(dirs, instance):
        data = f.read_bytes()
        for off in range(0, len(data) - 4096 + 1, 4096):
            if data[off : off + 8] == magic:
                out[(f, off)] = data[off : off + fixed]
    return out


def find_slots(dirs: list[Path], instance: str = "default") -> dict[int, tuple[Path, int]]:
    """{key: (pool file, offset of the slot's header)} for every header magic found in the pool."""
    koff, _ = header_format()[1]["key"]
    return {int.from_bytes(h[koff : koff + 8], "little"): at for at, h in header_slots(dirs, instance).items()}


def flip_bits(path: Path, offset: int, bits: list[int]) -> None:
    """Flips bits (numbered from bit 0 of byte `offset`, least significant first) in a file."""
    with open(path, "r+b") as f:
        span = max(bits) // 8 + 1
        f.seek(offset)
        buf = bytearray(f.read(span))
        for b in bits:
            buf[b // 8] ^= 1 << (b % 8)
        f.seek(offset)
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())


def object_offset(g: dict[str, int], layer: int, obj: int) -> int:
    return g["header_bytes"] + (layer * g["objs_per_layer"] + obj) * g["obj_bytes"]


def unit_bytes_equal(want: list, src: np.ndarray, kv: list, dst: np.ndarray) -> bool:
    """Whether the blocks `dst` of `kv` hold what the blocks `src` of `want` held (kv_first layout)."""
    return all(np.array_equal(w[:, src], k[:, dst]) for w, k in zip(want, kv))


def fresh_reader(dirs: list[Path], kv: list) -> TuttiStore:
    r = TuttiStore(TuttiConfig(paths=dirs, unit_tokens=UNIT_TOKENS))
    r.register_kv_caches(kv, block_tokens=16, read_only=True)
    return r


# ---- finding 1: IOCBs exhausted, incomplete requests -----------------------------------------
def _blocks(u: int, ub: int, base: int = 0) -> np.ndarray:
    return np.arange(base + u * ub, base + (u + 1) * ub)


def test_finding1_iocb_exhaustion_never_serves_unloaded_kv(store_dirs):
    """Many concurrent retrieves with a small IOCB table: each either fails at begin with
    CapacityExceeded (and reserves nothing) or finishes ok with byte-exact KV."""
    kv = make_kv(seed=101)
    n = 5
    with open_store(store_dirs, kv, iocb_depth=10) as s:
        ub = s.unit_blocks
        for u in range(n):
            assert s.store([1000 + u], _blocks(u, ub)).ok
        want = snapshot(kv)
        zero(kv)
        reqs, refused, layer_errors = {}, 0, []
        for u in range(n):
            try:
                reqs[u] = s.begin_retrieve([1000 + u], _blocks(u, ub, base=48))
            except CapacityExceeded:
                refused += 1
        for layer in range(s.num_layers):  # layer-major, as an engine runs its requests
            for u, req in reqs.items():
                try:
                    s.retrieve_layer(layer, req)
                except TuttiError as e:
                    layer_errors.append((u, layer, type(e).__name__, str(e)))
        results = {u: s.finish(req) for u, req in reqs.items()}
        assert reqs, "no request could begin"
        for u, res in results.items():
            if res.ok:
                assert unit_bytes_equal(want, _blocks(u, ub), kv, _blocks(u, ub, base=48)), (
                    f"request {u} finished ok with KV that was never loaded (layer errors: {layer_errors})")
        assert not layer_errors, f"layer calls failed after begin: {layer_errors}"
        assert refused + len(reqs) == n
        # Nothing leaked: with no request in flight the whole table is free again.
        ids = s.get_iocb(10)
        assert len(set(ids)) == 10
        for i in ids:
            s.put_iocb(i)
        # A unit that failed to load is a miss now, never a hit over wrong bytes.
        zero(kv)
        for u in range(n):
            if s.lookup([1000 + u]):
                assert s.retrieve([1000 + u], _blocks(u, ub, base=48)).ok
                assert unit_bytes_equal(want, _blocks(u, ub), kv, _blocks(u, ub, base=48))


def test_finding1_iocb_exhaustion_never_commits_a_missing_layer(store_dirs):
    """Concurrent stores with a small IOCB table: a committed unit has every layer, now and after a
    reopen; a unit that did not make it is absent."""
    kv = make_kv(seed=102)
    n = 5
    with open_store(store_dirs, kv, iocb_depth=10) as s:
        ub = s.unit_blocks
        reqs, layer_errors = {}, []
        for u in range(n):
            try:
                reqs[u] = s.begin_store([2000 + u], _blocks(u, ub))
            except CapacityExceeded:
                pass
        for layer in range(s.num_layers):
            for u, req in reqs.items():
                try:
                    s.store_layer(layer, req)
                except TuttiError as e:
                    layer_errors.append((u, layer, type(e).__name__, str(e)))
        results = {u: s.finish(req) for u, req in reqs.items()}
        assert reqs, "no request could begin"
        want = snapshot(kv)
        committed = [u for u, r in results.items() if r.committed_units == [0]]
        for u, r in results.items():
            if u not in committed:
                assert r.failed_units == [0] and s.lookup([2000 + u]) == 0, (u, r)
    zero(kv)
    for reopen in (False, True):
        with open_store(store_dirs, kv) as s:
            for u in committed:
                zero(kv)
                res = s.retrieve([2000 + u], _blocks(u, ub, base=48))
                assert res.ok, (u, res, reopen)
                assert unit_bytes_equal(want, _blocks(u, ub), kv, _blocks(u, ub, base=48)), (
                    f"unit {u} was committed without all its layers (reopened: {reopen}; layer errors: {layer_errors})")
            for u in set(range(n)) - set(committed):
                assert s.lookup([2000 + u]) == 0
    assert not layer_errors, f"layer calls failed after begin: {layer_errors}"
    assert committed


def test_finding1_finish_of_a_retrieve_with_unissued_layers_fails_every_unit(store_dirs):
    kv = make_kv(seed=103)
    with open_store(store_dirs, kv) as s:
        ub = s.unit_blocks
        assert s.store([1, 2], np.arange(2 * ub)).ok
        req = s.begin_retrieve([1, 2], np.arange(2 * ub) + 40)
        s.retrieve_layer(0, req)
        res = s.finish(req)
        assert not res.ok and res.failed_units == [0, 1], res
        assert res.incomplete_layers == [1, 2, 3]
        req = s.begin_retrieve([1, 2], np.arange(2 * ub) + 40)  # nothing at all issued
        res = s.finish(req)
        assert res.failed_units == [0, 1] and res.incomplete_layers == [0, 1, 2, 3], res


def test_finding1_finish_of_a_store_with_unissued_layers_commits_nothing(store_dirs):
    kv = make_kv(seed=104)
    with open_store(store_dirs, kv) as s:
        ub = s.unit_blocks
        assert s.store([9], np.arange(ub)).ok  # skipped below: already stored
        req = s.begin_store([7, 8, 9], np.arange(3 * ub))
        s.store_layer(0, req)
        s.store_layer(2, req)
        res = s.finish(req)
        assert res.committed_units == [] and res.skipped_units == 1, res
        assert res.failed_units == [0, 1], res
        assert res.incomplete_layers == [1, 3]
        assert s.lookup([7]) == 0 and s.lookup([8]) == 0
    with open_store(store_dirs, kv) as s:
        assert s.lookup([7]) == 0 and s.lookup([8]) == 0 and s.lookup([9]) == 1


# ---- finding 2: two-bit errors ---------------------------------------------------------------
def test_finding2_two_bit31_flips_in_an_object_are_a_miss(store_dirs):
    """Bit 31 of two 32-bit words of one object: cancelled in both position-weighted sums."""
    kv = make_kv(seed=105)
    keys = [11, 12, 13, 14]
    with open_store(store_dirs, kv) as s:
        ub = s.unit_blocks
        g = s.geometry()
        assert s.store(keys, np.arange(4 * ub)).ok
    slots = find_slots(store_dirs)
    assert set(keys) <= set(slots)
    for i, k in enumerate(keys):  # a different object of each unit, words i and 7i+5
        f, off = slots[k]
        base = object_offset(g, i % g["num_layers"], i % g["objs_per_layer"])
        flip_bits(f, off + base, [i * 32 + 31, (7 * i + 5) * 32 + 31])
    want = snapshot(kv)
    zero(kv)
    with open_store(store_dirs, kv) as s:
        for k in keys:
            with pytest.raises(NotFound):
                s.read_unit(k)
        res = s.retrieve(keys, np.arange(4 * ub) + 40)
        assert res.failed_units == [0, 1, 2, 3], res
        assert s.lookup(keys) == 0
    # Live, on an open store: the next retrieve is a miss.
    with open_store(store_dirs, kv) as s:
        assert s.store([21], np.arange(ub)).ok
        f, off = find_slots(store_dirs)[21]
        flip_bits(f, off + object_offset(g, 1, 1), [3 * 32 + 31, 100 * 32 + 31])
        with pytest.raises(NotFound):
            s.read_unit(21)
        zero(kv)
        res = s.retrieve([21], np.arange(ub) + 40)
        assert res.failed_units == [0], res
        assert s.lookup([21]) == 0


def test_finding2_two_bit31_flips_in_header_key_and_seq_leave_the_unit_absent(store_dirs):
    """The same flip in a header's key and commit sequence must not make a unit appear under a key
    that was never stored."""
    kv = make_kv(seed=106)
    _, fields, _ = header_format()
    with open_store(store_dirs, kv) as s:
        ub = s.unit_blocks
        assert s.store([31, 32], np.arange(2 * ub)).ok
    f, off = find_slots(store_dirs)[31]
    flip_bits(f, off + fields["key"][0], [31])
    flip_bits(f, off + fields["commit_seq"][0], [31])
    forged = 31 ^ (1 << 31)
    for open_ in (lambda: open_store(store_dirs, kv), lambda: fresh_reader(store_dirs, kv)):
        s = open_()
        try:
            assert s.lookup([31]) == 0
            assert s.lookup([forged]) == 0, "a unit is served under a key that was never stored"
            with pytest.raises(NotFound):
                s.read_unit(forged)
            assert s.lookup([32]) == 1
            assert s.stats()["bad_headers"] == 1
        finally:
            s.close()


# ---- finding 3: a flipped layout id ----------------------------------------------------------
def test_finding3_one_flipped_layout_id_byte_is_one_missing_unit(store_dirs):
    kv = make_kv(seed=107)
    _, fields, _ = header_format()
    keys = [41, 42, 43, 44]
    reader = None
    with open_store(store_dirs, kv) as s:
        ub = s.unit_blocks
        reader = fresh_reader(store_dirs, s.layers)  # open before the commits: sees them on refresh()
        assert s.store(keys, np.arange(4 * ub)).ok
    try:
        f, off = find_slots(store_dirs)[43]
        flip_bits(f, off + fields["layout_id"][0] + 2, [0, 1, 2, 3, 4, 5, 6, 7])
        reader.refresh()  # never an instance-wide error
        assert [reader.lookup([k]) for k in keys] == [1, 1, 0, 1]
    finally:
        reader.close()
    want = snapshot(kv)
    zero(kv)
    with open_store(store_dirs, kv) as s:
        assert [s.lookup([k]) for k in keys] == [1, 1, 0, 1]
        assert s.stats()["bad_headers"] == 1
        res = s.retrieve([41, 42], np.arange(2 * ub) + 40)
        assert res.ok
        assert unit_bytes_equal(want, np.arange(2 * ub), kv, np.arange(2 * ub) + 40)


def test_a_pool_of_another_layout_is_refused_naming_both(store_dirs):
    kv = make_kv(seed=108)
    with open_store(store_dirs, kv) as s:
        assert s.store([51], np.arange(s.unit_blocks)).ok
    other = [a.view(np.float16) for a in kv]  # same geometry, another engine dtype: a real mismatch
    mine = describe([layer_kv_from_tensor(a, "kv_first") for a in kv])
    theirs = describe([layer_kv_from_tensor(a, "kv_first") for a in other])
    assert mine != theirs
    with pytest.raises(LayoutError) as e:
        open_store(store_dirs, other)
    msg = str(e.value)
    assert re.search(rf"(?<![a-z]){re.escape(mine)}", msg) and re.search(rf"(?<![a-z]){re.escape(theirs)}", msg), msg
    with open_store(store_dirs, kv) as s:  # refused, never overwritten
        assert s.lookup([51]) == 1


# ---- finding 4: bounds of the native API (child process) -------------------------------------
def _case_store(tmp: Path, **kw) -> tuple[TuttiStore, list]:
    dirs = [tmp / "a", tmp / "b"]
    for d in dirs:
        d.mkdir()
    kv = make_kv(seed=109)
    s = open_store(dirs, kv, iocb_depth=8, **kw)
    assert s.store([1, 2], np.arange(2 * s.unit_blocks)).ok
    return s, kv


def _retrieve_req(s: TuttiStore) -> int:
    return s.begin_retrieve([1], np.arange(s.unit_blocks) + 40)


def _fill_issue(s: TuttiStore, req: int, *, layer: int = 0, first: int = 0, count: int = 2, op: str = "read",
                sms: int = 0):
    (i,) = s.get_iocb(1)

    def go():
        s.fill_iocb(i, op=op, layer=layer, req=req, first=first, count=count)
        s.issue_io([i], sms=sms)
        s.wait_cqe(i)
    return go


def _put_twice(s: TuttiStore):
    (i,) = s.get_iocb(1)
    s.put_iocb(i)
    return lambda: s.put_iocb(i)


def _never_twice(s: TuttiStore):
    (i,) = s.get_iocb(1)
    s.put_iocb(i)
    try:
        s.put_iocb(i)
    except TuttiError:
        pass

    def check():
        ids = s.get_iocb(8)
        assert len(set(ids)) == 8, f"get_iocb(8) handed out {sorted(ids)}"
        with pytest.raises(CapacityExceeded):
            s.get_iocb(1)
        for i in ids:
            s.put_iocb(i)
    return check


def _finished_req(s: TuttiStore) -> int:
    req = _retrieve_req(s)
    s.finish(req)
    return req


# name -> (setup(store) returning the call, kind): "raises": the call must raise a TuttiError
# subclass; "check": the call must return (its own assertions hold).
BOUNDS_CASES = {
    "fill_iocb_id_1e6": (lambda s: lambda: s.fill_iocb(10**6, op="read", layer=0, req=_retrieve_req(s), first=0, count=1), "raises"),
    "fill_iocb_id_negative": (lambda s: lambda: s.fill_iocb(-1, op="read", layer=0, req=_retrieve_req(s), first=0, count=1), "raises"),
    "put_iocb_1e6": (lambda s: lambda: s.put_iocb(10**6), "raises"),
    "put_iocb_negative": (lambda s: lambda: s.put_iocb(-1), "raises"),
    "put_iocb_twice": (_put_twice, "raises"),
    "get_iocb_never_hands_out_one_twice": (_never_twice, "check"),
    "get_iocb_negative": (lambda s: lambda: s.get_iocb(-1), "raises"),
    "get_iocb_1e6": (lambda s: lambda: s.get_iocb(10**6), "raises"),
    "iocb_of_a_request_that_does_not_exist": (lambda s: _fill_issue(s, 7), "raises"),
    "iocb_of_request_1e6": (lambda s: _fill_issue(s, 10**6), "raises"),
    "iocb_of_a_finished_request": (lambda s: _fill_issue(s, _finished_req(s)), "raises"),
    "iocb_of_request_negative": (lambda s: _fill_issue(s, -1), "raises"),
    "ioctx_range_past_the_request_end": (lambda s: _fill_issue(s, _retrieve_req(s), count=3), "raises"),
    "ioctx_first_past_the_request_end": (lambda s: _fill_issue(s, _retrieve_req(s), first=10**6, count=1), "raises"),
    "ioctx_first_negative": (lambda s: _fill_issue(s, _retrieve_req(s), first=-1, count=1), "raises"),
    "ioctx_count_above_an_iocb": (lambda s: _fill_issue(s, _retrieve_req(s), count=2049), "raises"),
    "ioctx_count_negative": (lambda s: _fill_issue(s, _retrieve_req(s), count=-1), "raises"),
    "iocb_layer_999": (lambda s: _fill_issue(s, _retrieve_req(s), layer=999), "raises"),
    "iocb_layer_negative": (lambda s: _fill_issue(s, _retrieve_req(s), layer=-1), "raises"),
    "issue_io_sms_negative": (lambda s: _fill_issue(s, _retrieve_req(s), sms=-1), "raises"),
    "issue_io_iocb_1e6": (lambda s: lambda: s.issue_io([10**6]), "raises"),
    "issue_io_iocb_not_taken": (lambda s: (lambda i: (s.put_iocb(i), lambda: s.issue_io([i]))[1])(s.get_iocb(1)[0]), "raises"),
    "wait_cqe_1e6": (lambda s: lambda: s.wait_cqe(10**6), "raises"),
    "wait_cqe_negative": (lambda s: lambda: s.wait_cqe(-1), "raises"),
    "retrieve_layer_999": (lambda s: (lambda r: lambda: s.retrieve_layer(999, r))(_retrieve_req(s)), "raises"),
    "retrieve_layer_negative": (lambda s: (lambda r: lambda: s.retrieve_layer(-1, r))(_retrieve_req(s)), "raises"),
    "store_layer_999": (lambda s: (lambda r: lambda: s.store_layer(999, r))(s.begin_store([77], np.arange(s.unit_blocks))), "raises"),
    "wait_layer_999": (lambda s: (lambda r: lambda: s.wait_layer(999, r))(_retrieve_req(s)), "raises"),
    "wait_layer_negative": (lambda s: (lambda r: lambda: s.wait_layer(-1, r))(_retrieve_req(s)), "raises"),
}


def _run_bounds_cases(names: list[str]) -> None:
    """Child process: runs each case on a fresh store, one JSON line per case."""
    for name in names:
        print(json.dumps({"begin": name}), flush=True)
        setup, kind = BOUNDS_CASES[name]
        with tempfile.TemporaryDirectory() as tmp:
            s, _kv = _case_store(Path(tmp))
            try:
                call = setup(s)
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                print(json.dumps({"case": name, "status": "setup failed", "detail": f"{type(e).__name__}: {e}"}), flush=True)
                s.close()
                continue
            try:
                call()
                status, detail = ("ok", "") if kind == "check" else ("no error", "the call returned")
            except TuttiError as e:
                status, detail = ("ok", f"{type(e).__name__}: {e}") if kind == "raises" else ("error", f"{type(e).__name__}: {e}")
            except AssertionError as e:
                status, detail = "check failed", str(e)
            except Exception as e:  # noqa: BLE001
                status, detail = "wrong error", f"{type(e).__name__}: {e}"
            # The process must still work: one clean retrieve after the bad call.
            try:
                live = [r for r in list(s._ops)]
                for r in live:
                    s.finish(r)
                ok = s.retrieve([2], np.arange(s.unit_blocks) + 60).ok
                if not ok and status == "ok":
                    status, detail = "broken after", "a clean retrieve failed after the call"
            except Exception as e:  # noqa: BLE001
                if status == "ok":
                    status, detail = "broken after", f"{type(e).__name__}: {e}"
            s.close()
            print(json.dumps({"case": name, "status": status, "detail": detail}), flush=True)


@lru_cache(maxsize=1)
def _bounds_results() -> dict[str, dict]:
    """Runs every case in child processes; a case that kills its child is reported as a crash and the
    remaining cases run in a new child."""
    results: dict[str, dict] = {}
    todo = list(BOUNDS_CASES)
    while todo:
        p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "bounds", *todo],
                           capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent)
        current = None
        for line in p.stdout.splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "begin" in msg:
                current = msg["begin"]
            elif "case" in msg:
                results[msg["case"]] = msg
                current = None
        if current is not None:
            results[current] = {"case": current, "status": "crashed",
                                "detail": f"child exited with {p.returncode}: {p.stderr[-1500:]}"}
        elif p.returncode != 0 and not results.keys() >= set(todo):
            nxt = next(n for n in todo if n not in results)
            results[nxt] = {"case": nxt, "status": "crashed", "detail": p.stderr[-1500:]}
        todo = [n for n in todo if n not in results]
    return results


@pytest.mark.parametrize("case", list(BOUNDS_CASES))
def test_finding4_native_api_bounds(case):
    r = _bounds_results()[case]
    assert r["status"] == "ok", f"{case}: {r['status']}: {r['detail']}"


# ---- finding 5: registered memory ------------------------------------------------------------
def _registered_memory_child(tmp: Path) -> None:
    import ctypes
    import gc

    dirs = [tmp / "a", tmp / "b"]
    for d in dirs:
        d.mkdir()
    kv = make_kv(seed=110)
    want = snapshot(kv)
    s = open_store(dirs, kv)
    ub = s.unit_blocks
    g = s.geometry()
    del kv
    gc.collect()
    churn = [np.full(BLOCKS * 8192 // 8, i + 1, dtype=np.uint64) for i in range(8)]  # reuse what was freed
    assert s.store([1, 2], np.arange(2 * ub)).ok
    data = s.read_unit(1)
    for layer in range(g["num_layers"]):
        for o in range(2):
            got = np.frombuffer(data, np.uint8, g["obj_bytes"], object_offset(g, layer, o))
            assert np.array_equal(got, want[layer][o, :ub].view(np.uint8).ravel()), (
                f"stored bytes of layer {layer} object {o} are not the registered KV")
    res = s.retrieve([1, 2], np.arange(2 * ub) + 40)
    assert res.ok, res
    for layer, l in enumerate(s.layers):
        for o, ptr in enumerate(l.ptrs):
            for b in range(2 * ub):
                got = bytes((ctypes.c_uint8 * l.block_bytes).from_address(ptr + (40 + b) * l.block_stride))
                assert got == want[layer][o, b].tobytes(), f"retrieved layer {layer} object {o} block {b}"
    del churn
    s.close()
    print("registered memory ok", flush=True)


def test_finding5_the_store_keeps_registered_kv_memory_alive(tmp_path):
    p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "memory", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent)
    assert p.returncode == 0 and "registered memory ok" in p.stdout, (
        f"exit {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")


@pytest.mark.parametrize("bad", ["read_only", "read_only_v_of_a_pair", "object_dtype"])
def test_finding5_unusable_arrays_are_refused(store_dirs, bad):
    if bad == "read_only_v_of_a_pair":
        kv, layout = make_kv("kv_tuple", seed=111), "kv_tuple"
        kv[1][1].flags.writeable = False
    else:
        kv, layout = make_kv(seed=111), "kv_first"
        if bad == "read_only":
            kv[2].flags.writeable = False
        else:
            # Every layer object-dtype (8-byte items, the same block size): only the dtype is wrong.
            kv = [np.empty(a.shape[:-1] + (a.shape[-1] // 4,), dtype=object) for a in kv]
    s = TuttiStore(TuttiConfig(paths=store_dirs, capacity_gb=0.02, unit_tokens=UNIT_TOKENS, staging_mb=2,
                               min_io_bytes=4096))
    try:
        with pytest.raises(LayoutError):
            s.register_kv_caches(kv, block_tokens=16, layout=layout)
    finally:
        s.close()



# ---- each failed unit named: key, pool file and slot, cause (issue 44) -------------------------
def test_a_damaged_object_names_its_unit_pool_file_slot_and_the_checksum(store_dirs):
    """One flipped byte in one object of one unit, on disk with the store closed: the retrieve after
    reopening reports that unit alone, with its key, the pool file and slot that hold it and cause
    ``checksum``; the unit is dropped, so the next retrieve finds it not present (no slot)."""
    kv = make_kv(seed=121)
    keys = [61, 62, 63]
    with open_store(store_dirs, kv) as s:
        ub, g = s.unit_blocks, s.geometry()
        assert s.store(keys, np.arange(3 * ub)).ok
    f, off = find_slots(store_dirs)[62]
    flip_bits(f, off + object_offset(g, 1, 1) + 9, [4])
    zero(kv)
    with open_store(store_dirs, kv) as s:
        res = s.retrieve(keys, np.arange(3 * ub) + 40)
        assert res.failed_units == [1], res
        assert res.failures == [UnitFailure(index=1, key=62, cause="checksum", pool_file=str(f),
                                            slot=off // g["slot_bytes"], offset=off)], res
        text = res.failures[0].describe()
        assert f"key 000000000000003e) in {f} slot {off // g['slot_bytes']}" in text and "checksum mismatch" in text
        again = s.retrieve([62], np.arange(ub) + 40)
        assert again.failures == [UnitFailure(index=0, key=62, cause="not_present")], again


def test_a_pool_file_cut_short_under_the_store_is_an_io_error_naming_the_slot(store_dirs):
    """A pool file truncated under an open store (a real short read from the file system): the unit
    in it fails as ``io_error`` naming that file and slot; the unit in the other file loads. (An
    errno such as EIO from the device itself cannot be caused here without a faulty block device.)"""
    kv = make_kv(seed=122)
    with open_store(store_dirs, kv, map_memory_paths=False) as s:
        ub, g = s.unit_blocks, s.geometry()
        assert s.store([71, 72], np.arange(2 * ub)).ok
        slots = find_slots(store_dirs)
        (f71, _), (f72, off) = slots[71], slots[72]
        assert f71 != f72  # consecutive units go to different paths
        os.truncate(f72, off + g["header_bytes"])
        res = s.retrieve([71, 72], np.arange(2 * ub) + 40)
        assert res.failed_units == [1], res
        (fail,) = res.failures
        assert (fail.index, fail.key, fail.cause, fail.pool_file, fail.slot, fail.offset) == (
            1, 72, "io_error", str(f72), off // g["slot_bytes"], off), fail
        assert fail.errno in (0, errno.EIO), fail  # 0: a short read
        assert "I/O error" in fail.describe()


def test_a_store_without_a_free_slot_names_the_cause(tmp_path):
    """A pool of two slots, one unit pinned and one being read: a store cannot take a slot, and
    its unit is reported ``no_free_slot`` (no pool file: it never had a slot)."""
    kv = make_kv(seed=123)
    probe = tmp_path / "probe"
    probe.mkdir()
    with open_store([probe], kv) as s:
        slot_bytes = s.geometry()["slot_bytes"]
    d = tmp_path / "small"
    d.mkdir()
    with open_store([d], kv, capacity_gb=2 * slot_bytes / (1 << 30)) as s:
        ub = s.unit_blocks
        assert s.stats()["total_slots"] == 2
        assert s.store([81, 82], np.arange(2 * ub)).ok
        s.pin([81])
        reading = s.begin_retrieve([82], np.arange(ub) + 40)
        for layer in range(s.num_layers):
            s.retrieve_layer(layer, reading)
        res = s.store([83], np.arange(ub) + 60)
        assert res.failed_units == [0] and res.committed_units == [], res
        assert res.failures == [UnitFailure(index=0, key=83, cause="no_free_slot")], res
        assert "no free slot" in res.failures[0].describe()
        assert s.finish(reading).ok
        s.unpin([81])

if __name__ == "__main__":
    if sys.argv[1] == "bounds":
        _run_bounds_cases(sys.argv[2:])
    elif sys.argv[1] == "memory":
        _registered_memory_child(Path(sys.argv[2]))

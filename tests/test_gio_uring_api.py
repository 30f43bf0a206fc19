"""The gio_uring API used directly (get_iocb / fill_iocb / issue_io / wait_cqe / put_iocb) beside
requests: an IOCB belongs to its caller, and a request's end never disturbs an IOCB filled for
another one."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import BLOCK_TOKENS, UNIT_TOKENS, assert_units_equal, make_kv, open_store, snapshot, zero
from tutti_cluster.errors import CapacityExceeded

UNIT_BLOCKS = UNIT_TOKENS // BLOCK_TOKENS


def test_an_iocb_refilled_for_another_request_stays_that_requests(store_dirs):
    kv = make_kv()
    want = snapshot(kv)
    blocks = np.arange(2 * UNIT_BLOCKS)
    with open_store(store_dirs, kv) as s:
        assert s.store([1, 2], blocks).ok
        zero(kv)
        a = s.begin_retrieve([1], blocks[:UNIT_BLOCKS])
        b = s.begin_retrieve([2], blocks[UNIT_BLOCKS:])
        (iocb,) = s.get_iocb(1)
        s.fill_iocb(iocb, op="read", layer=0, req=a, first=0, count=1)
        s.fill_iocb(iocb, op="read", layer=0, req=b, first=0, count=2)  # now b's
        s.finish(a)  # a never issued its layers: a miss, and the IOCB is left alone
        s.issue_io([iocb])
        assert s.wait_cqe(iocb) == 0
        s.put_iocb(iocb)
        for layer in range(s.num_layers):
            s.retrieve_layer(layer, b)
        assert s.finish(b).ok
        assert_units_equal(want, blocks, kv, blocks, "kv_first", [1], UNIT_BLOCKS)


def test_begin_refuses_a_request_the_iocb_table_cannot_hold_and_takes_nothing(store_dirs):
    kv = make_kv()
    blocks = np.arange(UNIT_BLOCKS)
    # Four layers: a retrieve needs four IOCBs, a store five (one more to commit).
    with open_store(store_dirs, kv, iocb_depth=6) as s:
        assert s.store([7], blocks).ok
        held = s.get_iocb(3)
        with pytest.raises(CapacityExceeded, match="IOCB table exhausted"):
            s.begin_store([8], blocks)
        # Nothing was evicted or reserved for it.
        assert s.lookup([7]) == 1 and s.stats()["free_slots"] == s.stats()["total_slots"] - 1
        for i in held:
            s.put_iocb(i)
        assert s.retrieve([7], blocks).ok


def test_finish_counts_layers_the_gio_uring_api_moved(store_dirs):
    """A retrieve whose every layer went through gio_uring IOCBs (in two ranges, one IOCB reused)
    is a hit at finish; one whose last layer is covered only in part is reported incomplete, and
    then every unit failed (a miss, the units kept)."""
    kv = make_kv()
    want = snapshot(kv)
    blocks = np.arange(2 * UNIT_BLOCKS)
    with open_store(store_dirs, kv) as s:
        assert s.store([1, 2], blocks).ok
        zero(kv)
        req = s.begin_retrieve([1, 2], blocks)  # 2 units x 2 objects: IOCTXs [0, 4)
        (iocb,) = s.get_iocb(1)
        for layer in range(s.num_layers):
            for first, count in ((0, 2), (2, 2)):
                s.fill_iocb(iocb, op="read", layer=layer, req=req, first=first, count=count)
                s.issue_io([iocb])
                assert s.wait_cqe(iocb) == 0
        res = s.finish(req)
        assert res.ok and res.incomplete_layers == [], res
        assert_units_equal(want, blocks, kv, blocks, "kv_first", [0, 1], UNIT_BLOCKS)
        req = s.begin_retrieve([1, 2], blocks)
        for layer in range(s.num_layers):
            s.fill_iocb(iocb, op="read", layer=layer, req=req, first=0, count=4 if layer else 3)
            s.issue_io([iocb])
            s.wait_cqe(iocb)
        s.put_iocb(iocb)
        res = s.finish(req)
        assert res.incomplete_layers == [0] and res.failed_units == [0, 1], res
        assert s.lookup([1, 2]) == 2


def test_a_store_through_the_gio_uring_api_commits(store_dirs):
    kv = make_kv()
    want = snapshot(kv)
    blocks = np.arange(UNIT_BLOCKS)
    with open_store(store_dirs, kv) as s:
        req = s.begin_store([9], blocks)
        ids = s.get_iocb(s.num_layers)
        for layer, iocb in enumerate(ids):
            s.fill_iocb(iocb, op="write", layer=layer, req=req, first=0, count=2)
        s.issue_io(ids)
        res = s.finish(req)  # waits for them
        assert res.ok and res.committed_units == [0], res
        for iocb in ids:
            s.put_iocb(iocb)
        zero(kv)
        assert s.retrieve([9], blocks).ok
        assert_units_equal(want, blocks, kv, blocks, "kv_first", [0], UNIT_BLOCKS)

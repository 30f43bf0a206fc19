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

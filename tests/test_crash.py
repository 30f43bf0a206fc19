"""Torn-write safety: SIGKILL a writer mid-store, restart, and every unit the index reports is byte-exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from conftest import make_kv, open_store, zero
from crash_writer import unit_data

HERE = Path(__file__).parent


def test_kill_9_mid_store_leaves_only_exact_units(tmp_path):
    d = tmp_path / "ssd"
    d.mkdir()
    rng = np.random.default_rng(0)
    start = 1
    for round_ in range(4):
        p = subprocess.Popen([sys.executable, str(HERE / "crash_writer.py"), str(d), str(start)],
                             stdout=subprocess.PIPE, text=True, cwd=HERE)
        # Wait until it has committed a few batches, then kill it at a random moment of a later one.
        for _ in range(3 + round_):
            line = p.stdout.readline()
            assert line, "writer died before committing"
        time.sleep(float(rng.uniform(0, 0.02)))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        start += 10_000
        kv = make_kv(seed=1)
        with open_store([d], kv, capacity_gb=0.01) as s:
            keys = s.keys()
            assert keys, "nothing survived"
            ub = s.unit_blocks
            for i in range(0, len(keys), 4):
                batch = keys[i : i + 4]
                zero(kv)
                res = s.retrieve(batch, np.arange(len(batch) * ub))
                assert res.ok, f"round {round_}: unit(s) {res.failed_units} of {batch} reported but not intact"
                for l in range(len(kv)):
                    for u, k in enumerate(batch):
                        np.testing.assert_array_equal(kv[l][:, u * ub : (u + 1) * ub], unit_data(k, kv[l].shape, ub, l))

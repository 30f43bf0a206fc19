"""A/B of the cluster plane's authentication: a 4,096-key directory lookup (warm, and cold: every
entry verified again) and one stage round trip (a ping: connect, handshake, ping; and a one-unit
stage stream), with whichever ``tutti_cluster`` is first on the path. Prints one JSON line.

Before and after, on one host, alternating (the tree before the cluster credential, unpacked and
built beside this one; sitecustomize drops the editable install's import redirect)::

    git archive 7260d8b | tar -x -C /tmp/tutti-base
    cmake -S /tmp/tutti-base -B /tmp/tutti-base-build -DTUTTI_CUDA=off -DCMAKE_BUILD_TYPE=Release \
      -Dpybind11_DIR="$(python -c 'import pybind11; print(pybind11.get_cmake_dir())')"
    cmake --build /tmp/tutti-base-build -j && cp /tmp/tutti-base-build/_native*.so /tmp/tutti-base/tutti_cluster/
    mkdir -p /tmp/base-site && printf '%s\n' 'import sys' \
      'sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]' \
      > /tmp/base-site/sitecustomize.py
    for i in 1 2; do
      PYTHONPATH=/tmp/base-site:/tmp/tutti-base AB_REPS=200 python tools/diag/cluster_auth_ab.py
      AB_REPS=200 python tools/diag/cluster_auth_ab.py
    done

The remote fetch's A/B is the cluster benchmark run the same way:
``[PYTHONPATH=...] python -m tutti_cluster.bench.cluster --quick --only fetch`` (in trees before the
benchmarks left the cluster package: ``tutti_cluster.cluster.bench``).
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tutti_cluster.cluster import stage as stage_mod
from tutti_cluster.cluster.directory import EtcdDirectory, NodeRecord
from tutti_cluster.cluster.stage import StageServer
try:
    from tutti_cluster.cluster.stage_stream import StageStream, ping
except ImportError:  # trees before the stage endpoint's split
    from tutti_cluster.cluster.stage import StageStream, ping  # type: ignore[attr-defined,no-redef]
from tutti_cluster.cluster.transfer import TransferNode

try:
    from tutti_cluster.bench.cluster import _Etcd
except ImportError:  # a tree from before the benchmarks left the cluster package
    from tutti_cluster.cluster.bench import _Etcd  # type: ignore[no-redef]

AUTH = "secret" in inspect.signature(StageServer.__init__).parameters
kw: dict[str, Any] = {}
if AUTH:
    from tutti_cluster.cluster.auth import ClusterSecret
    kw = {"secret": ClusterSecret.generate()}
reps = int(os.environ.get("AB_REPS", "40"))
out: dict[str, Any] = {"auth": AUTH, "tree": os.path.dirname(os.path.dirname(stage_mod.__file__))}

work = Path(tempfile.mkdtemp(prefix="ab-auth-"))
etcd = _Etcd(work)
try:
    writer = EtcdDirectory(etcd.endpoint, "ab-writer", lease_ttl_s=30, timeout_s=30, **kw)
    reader = EtcdDirectory(etcd.endpoint, "ab-reader", timeout_s=30, **kw)
    keys = [0xD1_0000_0000 + i * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF for i in range(4096)]
    writer.register(keys)
    writer.start(NodeRecord("ab-writer", "", ""))
    assert len(reader.lookup(keys)) == 4096
    lat = []
    for _ in range(reps):
        t0 = time.perf_counter()
        n = len(reader.lookup(keys))
        lat.append((time.perf_counter() - t0) * 1e3)
        assert n == 4096
    out["lookup_4096_ms_p50"] = statistics.median(lat)
    out["lookup_4096_ms_min"] = min(lat)
    # Cold: every entry verified again (the verified-entry memory emptied before each lookup).
    lat = []
    for _ in range(reps):
        getattr(reader, "_verified", {}).clear()
        t0 = time.perf_counter()
        n = len(reader.lookup(keys))
        lat.append((time.perf_counter() - t0) * 1e3)
        assert n == 4096
    out["lookup_4096_cold_ms_p50"] = statistics.median(lat)
    writer.stop(revoke=True)
    reader.stop(revoke=False)
finally:
    etcd.stop()
    shutil.rmtree(work, ignore_errors=True)

UNIT = 64 << 10
owner = TransferNode(arena_bytes=4 * UNIT, slot_bytes=UNIT)
requester = TransferNode(arena_bytes=3 * UNIT, slot_bytes=UNIT)
units = {1: os.urandom(UNIT)}
srv = StageServer(owner, units.get, **kw).start()
try:
    pkw = {"secret": kw["secret"]} if AUTH else {}
    assert ping(srv.address, **pkw)
    lat = []
    for _ in range(reps * 5):
        t0 = time.perf_counter()
        ok = ping(srv.address, **pkw)
        lat.append((time.perf_counter() - t0) * 1e3)
        assert ok
    out["ping_ms_p50"] = statistics.median(lat)
    lat = []
    for _ in range(reps * 3):
        t0 = time.perf_counter()
        s = StageStream(requester, srv.address, owner.segment, [1], **kw)
        got = [bytes(v) for _, v in s]
        lat.append((time.perf_counter() - t0) * 1e3)
        assert got == [units[1]], s.error
    out["one_unit_stage_ms_p50"] = statistics.median(lat)
finally:
    srv.stop()
    owner.close()
    requester.close()
print(json.dumps(out))

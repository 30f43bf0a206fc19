"""A/B of etcd clients on one etcd: a 4096-key batched lookup, as the directory sends it.

Runs the current client (``tutti_cluster.cluster.etcd``, over python3-etcd3) against the
hand-encoded client of an older revision (loaded from git), alternating rounds on the same etcd
server, same keys, same transactions (4 concurrent transactions of 1024 keys-only range reads,
each key held by 2 nodes), parsing included.

    python tools/diag/etcd_client_ab.py [--old-rev 7717fbf] [--rounds 30]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the etcd fixtures of the tests

from cluster_fixtures import EtcdServer, require_etcd  # noqa: E402


def load_old(rev: str):  # type: ignore[no-untyped-def]
    src = subprocess.run(["git", "show", f"{rev}:tutti_cluster/cluster/etcd.py"], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    path = Path(tempfile.mkdtemp()) / "old_etcd.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_etcd", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["old_etcd"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def lookup(mod, client, keys: list[int], chunk: int = 1024) -> int:  # type: ignore[no-untyped-def]
    ops = []
    for k in keys:
        start = f"tutti/u/{k:016x}/".encode()
        ops.append(mod.op_range(start, mod.prefix_end(start), keys_only=True))
    res = client.txn_many([ops[i:i + chunk] for i in range(0, len(ops), chunk)])
    return sum(len([kv.key.decode().rsplit("/", 1)[1] for kv in r or ()]) for part in res for r in part)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-rev", default="7717fbf")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--keys", type=int, default=4096)
    args = ap.parse_args()
    require_etcd()
    from tutti_cluster.cluster import etcd as new

    old = load_old(args.old_rev)
    with tempfile.TemporaryDirectory() as tmp:
        server = EtcdServer(Path(tmp))
        server.start()
        try:
            c_new = new.EtcdClient(server.endpoint, timeout_s=10)
            c_old = old.EtcdClient(server.endpoint, timeout_s=10)
            keys = [(0x9E3779B97F4A7C15 * (i + 1)) & 0xFFFFFFFFFFFFFFFF for i in range(args.keys)]
            for node in ("A", "B"):
                puts = [new.op_put(f"tutti/u/{k:016x}/{node}".encode()) for k in keys]
                c_new.txn_many([puts[i:i + 1024] for i in range(0, len(puts), 1024)])
            times: dict[str, list[float]] = {"python3-etcd3": [], "hand-encoded": []}
            for name, mod, c in (("python3-etcd3", new, c_new), ("hand-encoded", old, c_old)):
                assert lookup(mod, c, keys) == 2 * len(keys), name  # warm-up and check
            for _ in range(args.rounds):
                for name, mod, c in (("python3-etcd3", new, c_new), ("hand-encoded", old, c_old)):
                    t0 = time.perf_counter()
                    lookup(mod, c, keys)
                    times[name].append(time.perf_counter() - t0)
            for name, ts in times.items():
                ms = sorted(t * 1e3 for t in ts)
                print(f"{name:14s} {args.keys}-key lookup: median {statistics.median(ms):6.1f} ms, "
                      f"p10 {ms[len(ms) // 10]:6.1f}, p90 {ms[len(ms) * 9 // 10]:6.1f} ms ({args.rounds} rounds)")
            c_new.close()
            c_old.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()

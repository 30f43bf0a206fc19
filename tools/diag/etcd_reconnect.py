"""How long after an etcd outage the directory finds remote units again (measurement, not a test).

Node A registers three units under a 3 s lease, etcd is stopped for ``outage`` seconds while node
B keeps looking them up (misses), then etcd starts again on the same port and data dir; prints how
long after the restart B's lookups hit again and how many leases A had to take.
``--grpc-defaults`` runs the same with gRPC's default channel options (reconnect backoff up to 120 s).

    python tools/diag/etcd_reconnect.py [--outage 60] [--grpc-defaults]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the etcd fixtures of the tests

from cluster_fixtures import EtcdServer, require_etcd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outage", type=float, default=60.0)
    ap.add_argument("--grpc-defaults", action="store_true")
    args = ap.parse_args()
    require_etcd()
    import tutti_cluster.cluster.etcd as etcd_client
    from tutti_cluster.cluster.auth import ClusterSecret
    from tutti_cluster.cluster.directory import EtcdDirectory, NodeRecord

    if args.grpc_defaults:
        etcd_client.GRPC_OPTIONS.clear()
    with tempfile.TemporaryDirectory() as tmp:
        e = EtcdServer(Path(tmp))
        e.start()
        secret = ClusterSecret.generate()  # both nodes' cluster credential
        a = EtcdDirectory(e.endpoint, "A", lease_ttl_s=3, secret=secret)
        a.start(NodeRecord("A", "seg", "stage"))
        b = EtcdDirectory(e.endpoint, "B", lease_ttl_s=3, secret=secret)
        try:
            a.register([1, 2, 3])
            assert b.lookup([1, 2, 3]) == [["A"]] * 3
            e.stop()
            down = time.monotonic()
            while time.monotonic() - down < args.outage:
                b.lookup([1])
                time.sleep(0.2)
            t0 = time.monotonic()
            e.start()
            t1 = time.monotonic()
            while b.lookup([1, 2, 3]) != [["A"]] * 3:
                time.sleep(0.05)
            t2 = time.monotonic()
            print(f"outage {args.outage:.0f} s, {'gRPC defaults' if args.grpc_defaults else 'GRPC_OPTIONS'}: "
                  f"etcd healthy {t1 - t0:.2f} s after its start; lookups hit again {t2 - t0:.2f} s after the "
                  f"start ({t2 - t1:.2f} s after healthy); leases granted to A: {a.stats.leases_granted}")
        finally:
            a.stop()
            b.stop()
            e.stop()


if __name__ == "__main__":
    main()

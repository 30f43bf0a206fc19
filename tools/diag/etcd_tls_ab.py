"""A/B of the directory's 4096-key lookup: plaintext etcd against etcd with TLS, client certificates
and authentication (a user with readwrite on ``tutti/``), both started here from the same binary,
alternating rounds, same keys (each held by 2 nodes), parsing included.

    python tools/diag/etcd_tls_ab.py [--rounds 30] [--keys 4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the etcd fixtures of the tests

from cluster_fixtures import EtcdServer, require_etcd  # noqa: E402
from test_etcd_tls import PASSWORD, SecureEtcd, make_certificates  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--keys", type=int, default=4096)
    args = ap.parse_args()
    require_etcd()
    from tutti_cluster.cluster.auth import ClusterSecret
    from tutti_cluster.cluster.directory import EtcdDirectory, NodeRecord
    from tutti_cluster.cluster.etcd import EtcdSecurity
    from tutti_cluster.config import TuttiConfig

    secret = ClusterSecret.generate()
    keys = list(range(1, args.keys + 1))
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        make_certificates(d)
        (d / "password").write_text(PASSWORD)
        (d / "password").chmod(0o600)
        (d / "plain").mkdir()
        plain = EtcdServer(d / "plain")
        plain.start()
        secure = SecureEtcd(d)
        secure.start()
        secure.enable_auth()
        cfg = TuttiConfig(etcd=[f"https://{secure.endpoint}"], etcd_ca_file=d / "ca.crt",
                          etcd_cert_file=d / "node.crt", etcd_key_file=d / "node.key", etcd_user="tutti",
                          etcd_password_file=d / "password")
        sec = EtcdSecurity.from_config(cfg)
        sides: dict[str, tuple[str, EtcdSecurity | None]] = {"plaintext": (plain.endpoint, None),
                                                             "tls+auth": (",".join(cfg.etcd), sec)}
        readers: dict[str, EtcdDirectory] = {}
        owners: list[EtcdDirectory] = []
        for name, (ep, s) in sides.items():
            for o in ("O1", "O2"):
                od = EtcdDirectory(ep, o, lease_ttl_s=60, timeout_s=30, security=s, secret=secret)
                od.start(NodeRecord(o, "127.0.0.1:1", "127.0.0.1:2"))
                assert od.register(keys)
                owners.append(od)
            readers[name] = EtcdDirectory(ep, "R", timeout_s=30, security=s, secret=secret)
            assert len(readers[name].lookup(keys)) == len(keys)  # warm: channel, token
        times: dict[str, list[float]] = {n: [] for n in readers}
        for _ in range(args.rounds):
            for name, r in readers.items():
                t0 = time.perf_counter()
                n = len(r.lookup(keys))
                times[name].append(time.perf_counter() - t0)
                assert n == len(keys)
        for name, ts in times.items():
            print(f"{name:10s} {args.keys}-key lookup: median {statistics.median(ts) * 1e3:.1f} ms, "
                  f"min {min(ts) * 1e3:.1f} ms ({args.rounds} rounds)")
        for od in owners:
            od.stop()
        for r in readers.values():
            r.stop(revoke=False)
        secure.stop()
        plain.stop()


if __name__ == "__main__":
    main()

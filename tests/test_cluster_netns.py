"""Cluster mode across hosts: each node in its own network namespace with its own address.

A bridge in the root namespace joins one veth per node; etcd listens on the bridge. This checks
that nodes advertise a reachable address (not loopback) and that a network partition, unlike a
process death, costs a bounded wait and no error. Needs root (CAP_NET_ADMIN) and `ip`; skips
otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cluster_fixtures import EtcdServer, NodeProcess, close_all, require_etcd, require_mooncake, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LEASE_TTL = 3
KEYS = [0xC100 + i for i in range(5)]


def sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True)


class Hosts:
    """One bridge and one namespace per node name, on subnet 10.<a>.<b>.0/24."""

    def __init__(self, names: list[str]) -> None:
        tag = f"{os.getpid() % 10000}"
        self.bridge = f"tbr{tag}"
        n = os.getpid() % 250 + 1
        self.net = f"10.79.{n}"
        self.ns = {name: f"tns{tag}{name}" for name in names}
        self.veth = {name: f"tv{tag}{name}" for name in names}
        self.ip = {name: f"{self.net}.{i + 2}" for i, name in enumerate(names)}
        self.gateway = f"{self.net}.1"
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for name in names:
            ns, veth = self.ns[name], self.veth[name]
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p")
            sh("ip", "link", "set", veth + "p", "netns", ns)
            sh("ip", "link", "set", veth, "master", self.bridge)
            sh("ip", "link", "set", veth, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip[name]}/24", "dev", veth + "p")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", veth + "p", "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")

    def prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[name]]

    def cut(self, name: str) -> None:
        sh("ip", "link", "set", self.veth[name], "down")

    def heal(self, name: str) -> None:
        sh("ip", "link", "set", self.veth[name], "up")

    def close(self) -> None:
        for name, ns in self.ns.items():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            subprocess.run(["ip", "link", "del", self.veth[name]], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@pytest.fixture
def hosts(tmp_path: Path):
    require_etcd()
    require_mooncake()
    if shutil.which("ip") is None:
        pytest.skip("iproute2 'ip' is not installed")
    try:
        h = Hosts(["A", "B", "C"])
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces (needs root): {exc.stderr.decode().strip()}")
    etcd = EtcdServer(tmp_path, host=h.gateway)
    try:
        etcd.start()
        nodes = {n: NodeProcess(n, etcd.endpoint, tmp_path, lease_ttl_s=LEASE_TTL, prefix=h.prefix(n))
                 for n in ("A", "B", "C")}
        yield h, etcd, nodes
        close_all(nodes.values())
    finally:
        etcd.stop()
        h.close()



def test_nodes_advertise_their_own_address_and_serve_across_hosts(hosts):
    h, _, nodes = hosts
    st = nodes["A"].call(op="stats")["daemon"]
    assert st["segment"].startswith(h.ip["A"] + ":") and st["stage_address"].startswith(h.ip["A"] + ":")
    assert nodes["A"].call(op="store", keys=KEYS)["units"] == len(KEYS)
    for name in ("B", "C"):
        f = nodes[name].call(op="fetch", keys=KEYS)
        assert f["placed"] == len(KEYS) and f["exact"] == [True] * len(KEYS), f


def test_partitioned_owner_costs_a_bounded_wait_and_comes_back(hosts):
    h, _, nodes = hosts
    assert nodes["A"].call(op="store", keys=KEYS)["ok"]
    assert wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS)["hits"] == len(KEYS), 5)
    h.cut("A")
    # Still listed, but unreachable: the fetch gives up after its connect deadline, without error.
    f = nodes["B"].call(op="fetch", keys=KEYS, timeout=30)
    assert f["ok"] and f["placed"] == 0
    # A cannot renew its lease: its entries expire. A itself keeps its local hits.
    assert wait_for(lambda: nodes["B"].call(op="lookup", keys=KEYS)["hits"] == 0, LEASE_TTL + 4)
    f = nodes["A"].call(op="fetch", keys=KEYS, timeout=30)
    assert f["local"] == len(KEYS) and all(f["exact"]) and len(f["exact"]) == len(KEYS)
    h.heal("A")
    # Back on the network, A finds its lease gone, takes a new one and re-registers everything.
    assert wait_for(lambda: nodes["C"].call(op="lookup", keys=KEYS)["hits"] == len(KEYS), LEASE_TTL * 3 + 5)
    f = nodes["C"].call(op="fetch", keys=KEYS)
    assert f["placed"] == len(KEYS) and all(f["exact"])

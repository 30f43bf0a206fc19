"""Cluster mode: replica directory in etcd, remote fetch over the Mooncake Transfer Engine.

- :mod:`.directory`: `EtcdDirectory`, the lease-bound replica directory under ``tutti/``.
- :mod:`.transfer`: `TransferNode`, a Transfer Engine with a registered staging arena.
- :mod:`.stage`: the stage endpoint (owner) and `StageStream` (requester).
- :mod:`.client`: `ClusterClient`, local-first lookup and remote fetch for an engine's store.

The remote fetch and lookup benchmark is :mod:`tutti_cluster.bench.cluster` (``tutti bench cluster``).
Importing this package does not import etcd3 or mooncake; each module imports them when used.
"""

"""Cluster mode: replica directory in etcd, remote fetch over the Mooncake Transfer Engine.

- :mod:`.directory`: `EtcdDirectory`, the lease-bound replica directory under ``tutti/``.
- :mod:`.transfer`: `TransferNode`, a Transfer Engine with a registered staging arena.
- :mod:`.stage`: the stage endpoint (owner) and `StageStream` (requester).
- :mod:`.client`: `ClusterClient`, local-first lookup and remote fetch for an engine's store.
- :mod:`.bench`: remote fetch and lookup benchmark.

Importing this package does not import etcd3 or mooncake; each module imports them when used.
"""

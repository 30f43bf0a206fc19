"""The Tutti admin plane: a FastAPI service over the node daemon's socket and the cluster directory.

``tutti_control`` never imports the native module: a node's admin API talks to its node daemon
through the daemon's unix socket (:class:`tutti_cluster.node.link.DaemonLink`), and the cluster-wide
admin finds the nodes in the cluster directory (:class:`tutti_cluster.cluster.directory.EtcdDirectory`)
and asks each node's admin API. The FastAPI app is built by :func:`tutti_control.app.create_app`;
:mod:`tutti_control.serve` runs it under uvicorn; :mod:`tutti_control.cli` is the ``tutti admin``
client (httpx only).
"""

__version__ = "0.1.0"

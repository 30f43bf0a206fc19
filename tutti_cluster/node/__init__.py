"""The node: its daemon (`tutti up`) and the engines' link to it.

- :mod:`~tutti_cluster.node.protocol`: every request and reply as a model, the socket's constants;
  both sides import it.
- :mod:`~tutti_cluster.node.daemon`: :class:`NodeDaemon` (shares, the node-wide index, state files,
  cluster bring-up, the socket server) and :func:`run_daemon`;
  :mod:`~tutti_cluster.node.admin_ops` its admin operations, :mod:`~tutti_cluster.node.pool_view`
  its read-only view of an engine's pools, :mod:`~tutti_cluster.node.handlers` its op table.
- :mod:`~tutti_cluster.node.link`: :class:`DaemonLink`, the engine's client (the protocol only).

Nothing is imported here: an engine that imports the link loads no server code.
"""

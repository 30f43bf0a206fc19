"""Tutti-cluster: an SSD-backed KV-cache store for long-context LLM serving."""

from tutti_cluster import errors
from tutti_cluster.config import TuttiConfig, load_config
from tutti_cluster.kv_layout import LayerKV, layer_kv_from_tensor
from tutti_cluster.store import RequestResult, TuttiStore, UnitFailure

__all__ = ["TuttiStore", "TuttiConfig", "LayerKV", "RequestResult", "UnitFailure", "errors", "layer_kv_from_tensor",
           "load_config"]
__version__ = "0.1.0"

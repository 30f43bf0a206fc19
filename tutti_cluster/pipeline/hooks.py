"""The calls a prefill makes around each layer: the interface between a model's forward pass and
the I/O that moves its prefix's KV (:class:`~tutti_cluster.pipeline.scheduler.SlackScheduler`)."""

from __future__ import annotations


class LayerHooks:
    """Calls a prefill makes around each layer, for a caller that moves the prefix's KV.

    ``before_layer(l)`` runs before layer ``l``'s projections (issue reads ahead), ``before_attention(l)``
    after the suffix's K and V are in the cache and before attention reads the prefix (wait for its
    KV), ``after_layer(l)`` once layer ``l``'s work is queued (its KV blocks are final: writes may go).
    """

    def before_layer(self, layer: int) -> None:
        pass

    def before_attention(self, layer: int) -> None:
        pass

    def after_layer(self, layer: int) -> None:
        pass

"""The node daemon's handlers: one per request model of :mod:`tutti_cluster.node.protocol`,
registered with :func:`handles` on the daemon's methods (``daemon.py``, ``admin_ops.py``)."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from tutti_cluster.node.protocol import Reply, Request

_R = TypeVar("_R", bound=Request)
# op name -> (request model, handler). Handlers are NodeDaemon methods taking their model.
HANDLERS: dict[str, tuple[type[Request], Callable[..., Reply]]] = {}


def handles(model: type[_R]) -> Callable[[Callable[[Any, _R], Reply]], Callable[[Any, _R], Reply]]:
    """Registers the decorated NodeDaemon method as the handler of ``model``'s op."""

    def register(fn: Callable[[Any, _R], Reply]) -> Callable[[Any, _R], Reply]:
        name = model.op_name()
        if name in HANDLERS:
            raise TypeError(f"daemon op {name!r} has two handlers")
        HANDLERS[name] = (model, fn)
        return fn

    return register

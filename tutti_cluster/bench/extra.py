"""The ``bench`` extra (``pip install 'tutti-cluster[bench]'``): the modules it brings, progress bars
and plots, and the check ``tutti bench`` and ``tutti profile`` make before any work (the cluster and
vLLM benches need neither module)."""

from __future__ import annotations

import importlib

MODULES = ("tqdm", "matplotlib")


def check_extra() -> None:
    """ImportError, naming the missing module, unless the ``bench`` extra is installed (the command
    line turns it into one line saying what to install)."""
    for name in MODULES:
        importlib.import_module(name)

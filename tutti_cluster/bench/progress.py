"""The benchmarks' progress bar: tqdm on stderr, notes between its redraws on stdout."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, desc: str, unit: str = "step", show: bool = True) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, disable=not show)

    def step(self, text: str) -> None:
        self._bar.set_postfix_str(text, refresh=False)
        self._bar.update(1)

    def note(self, text: str) -> None:
        self._bar.write(text, file=sys.stdout)

    def close(self) -> None:
        self._bar.close()

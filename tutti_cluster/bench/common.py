"""Types shared by the benchmark's systems and runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Round:
    """One store-then-retrieve round of one prefix through one system.

    Logical block ``i`` of the prefix is read from physical block ``store_ids[i]`` when storing
    and must land in physical block ``retrieve_ids[i]`` when retrieving (two independent random
    permutations, as when a later request reuses an earlier request's prefix).
    """

    prefix_tokens: int
    n_blocks: int
    store_ids: torch.Tensor
    retrieve_ids: torch.Tensor
    tag: str


@dataclass
class OpTiming:
    """What a system reports about one operation; the runner adds wall and process CPU time.

    ``engine_cpu_s`` is the CPU time of the calling (engine) thread spent inside the calls that
    issue the transfer: ``store_layer``/``retrieve_layer`` for tutti, submitting the per-block or
    per-chunk jobs for the baselines.
    """

    engine_cpu_s: float
    call_cpu_us: tuple[float, ...] = ()  # per issuing call, where the system reports them


class BenchSystem(Protocol):
    """A KV transfer system under test."""

    name: str
    ops: tuple[str, ...]  # the operations it is measured on ("store", "retrieve")

    def prepare(self, rnd: Round) -> None:
        """Untimed: set up for the round (open stores, allocate staging) so that no timed pass pays
        for one-off setup."""
        ...

    def store(self, rnd: Round) -> OpTiming:
        """Persist the round's prefix from the KV tensors; returns once it is on storage."""
        ...

    def before_read(self, rnd: Round) -> None:
        """Untimed: drop whatever cached copy of the stored data this system's reads could hit."""
        ...

    def retrieve(self, rnd: Round) -> OpTiming:
        """Load the round's prefix into the KV tensors at ``retrieve_ids``; returns when in place."""
        ...

    def end_round(self, rnd: Round) -> None:
        """Untimed: free the round's storage."""
        ...

    def release(self) -> None:
        """Untimed: free what stays between rounds of one prefix (a store's pool files)."""
        ...

    def close(self) -> None:
        """Release everything (files, stores, threads)."""
        ...

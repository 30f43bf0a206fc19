"""Benchmark-specific errors, inside the project's hierarchy."""

from __future__ import annotations

from tutti_cluster.errors import TuttiError


class BenchVerificationError(TuttiError):
    """A system under test put wrong bytes into the KV cache (its figures must not be reported)."""


class RankFailed(TuttiError):
    """A tensor-parallel rank of a bench run failed or died; the others were stopped."""

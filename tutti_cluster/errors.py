"""Exceptions raised by Tutti. Every error the store reports is a :class:`TuttiError`."""

from __future__ import annotations


class TuttiError(Exception):
    """Base class of every Tutti error."""


class NotFound(TuttiError):
    """A key, unit or object is absent (or failed its checksum, which counts as absent)."""


class CapacityExceeded(TuttiError):
    """The file pool, staging area, IOCB table or disk is full."""


class StorageError(TuttiError):
    """An I/O failure: missing or read-only directory, short read, refused O_DIRECT, ..."""


class DeviceError(TuttiError):
    """The device backend failed or is not available."""


class ConfigError(TuttiError):
    """The configuration is invalid."""


class LayoutError(TuttiError):
    """A KV tensor, block id, shape, dtype or layout does not fit the store."""


__all__ = [
    "TuttiError",
    "NotFound",
    "CapacityExceeded",
    "StorageError",
    "DeviceError",
    "ConfigError",
    "LayoutError",
]

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


class ConfigError(TuttiError, ValueError):
    """The configuration, or a request to the node daemon, is invalid.

    Also a ValueError, so that code which treats bad settings as bad values keeps working."""


class LayoutError(TuttiError):
    """A KV tensor, block id, shape, dtype or layout does not fit the store."""


def error_class(name: str) -> type[TuttiError]:
    """The TuttiError subclass called ``name`` (how an error crosses the daemon socket); TuttiError
    itself for a name this version does not know."""
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, TuttiError):
        return cls
    return TuttiError


__all__ = [
    "TuttiError",
    "NotFound",
    "CapacityExceeded",
    "StorageError",
    "DeviceError",
    "ConfigError",
    "LayoutError",
]

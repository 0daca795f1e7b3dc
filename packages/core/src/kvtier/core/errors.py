"""Exceptions raised by kvtier. Every error names what was wrong and, where it can, how to fix
it."""

from __future__ import annotations

from kvtier.core.config.masking import shown


class KVTierError(Exception):
    """Base class of every kvtier error."""


class ConfigError(KVTierError, ValueError):
    """A configuration field has a bad value. ``field`` names it, ``value`` is what was given,
    with secrets masked (a password, a key, the password in a URL never appear)."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value = shown(field, value)
        self.reason = reason
        super().__init__(f"invalid kvtier config {field}={value!r}: {reason}")


class LayoutError(KVTierError, ValueError):
    """A KV cache tensor has a shape, dtype or layout kvtier does not know how to move."""


class PlatformError(KVTierError, RuntimeError):
    """No usable platform, an unknown platform name, or an ambiguous choice."""


class OutOfHostMemory(KVTierError, MemoryError):
    """The host arena cannot hold an object even after evicting what may be evicted."""


class ClosedError(KVTierError, RuntimeError):
    """A kvtier object was used after its ``close()`` (an engine, a storage manager)."""


class DoubleReleaseError(KVTierError, RuntimeError):
    """A memory object handle was released twice (or used after release)."""


class MissingExtraError(KVTierError, ImportError):
    """An optional part of kvtier is not installed; the message names the extra to install."""

    def __init__(self, what: str, extra: str) -> None:
        super().__init__(f"{what} is not installed: install kvtier[{extra}] to use it")

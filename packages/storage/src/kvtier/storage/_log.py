"""Warnings that a failing tier would otherwise repeat on every chunk (``kvtier.core.warn``),
logged as ``kvtier.storage``."""

from __future__ import annotations

import logging

from kvtier.core.warn import warn_throttled as _warn

logger = logging.getLogger("kvtier.storage")


def warn_throttled(topic: str, msg: str, *args: object, every_s: float = 10.0) -> None:
    """Log ``msg`` at WARNING at most once per ``every_s`` seconds per ``topic``."""
    _warn(topic, msg, *args, every_s=every_s, log=logger)

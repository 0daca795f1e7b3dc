"""Warnings that a failing tier would otherwise repeat on every chunk."""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("kvtier.storage")

_lock = threading.Lock()
_last: dict[str, float] = {}


def warn_throttled(topic: str, msg: str, *args: object, every_s: float = 10.0) -> None:
    """Log ``msg`` at WARNING at most once per ``every_s`` seconds per ``topic``."""
    now = time.monotonic()
    with _lock:
        if now - _last.get(topic, -every_s) < every_s:
            return
        _last[topic] = now
    logger.warning(msg, *args)

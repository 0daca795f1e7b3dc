"""Warnings that a failing part would otherwise repeat on every chunk or every step."""

from __future__ import annotations

import logging
import threading
import time

_lock = threading.Lock()
_last: dict[str, float] = {}


def warn_throttled(
    topic: str,
    msg: str,
    *args: object,
    every_s: float = 10.0,
    log: logging.Logger | None = None,
) -> None:
    """Log ``msg`` at WARNING (to ``log``, default ``kvtier``) at most once per ``every_s``
    seconds per ``topic``."""
    now = time.monotonic()
    with _lock:
        if now - _last.get(topic, -every_s) < every_s:
            return
        _last[topic] = now
    (log or logging.getLogger("kvtier")).warning(msg, *args)

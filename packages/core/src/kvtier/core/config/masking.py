"""Secrets as errors, ``repr`` and logs may show them: the Redis password, the encryption key and
the password inside a Redis URL become ``***``."""

from __future__ import annotations

import urllib.parse
from typing import Any

MASK = "***"


def mask_url(url: str) -> str:
    """``url`` with the password of its user-info part replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return MASK
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{host}"))


def shown(name: str, value: Any) -> Any:
    """``value`` as an error or ``repr`` may show it: secrets masked."""
    if value is None:
        return None
    if "password" in name or "secret" in name or name == "encryption_key":
        return MASK
    if "url" in name and isinstance(value, str):
        return mask_url(value)
    return value

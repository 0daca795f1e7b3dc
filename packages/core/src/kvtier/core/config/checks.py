"""Checks of a ``KVTierConfig`` beyond each field's type.

``validated`` runs on every config however it is built (``load_config``, ``replace``, the
constructor). A ``ConfigError`` names the field and shows its value with secrets masked
(``masking``): the Redis password, the encryption key, and the password inside a Redis URL
never appear.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, get_type_hints

from kvtier.core.config.masking import MASK
from kvtier.core.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

_POSITIVE_INT = (
    "chunk_size",
    "write_queue_size",
    "io_threads",
    "store_threshold",
    "verify_max_tokens",
)
_POSITIVE_FLOAT = (
    "local_cpu_size_gb",
    "local_disk_size_gb",
    "node_size_gb",
    "redis_connect_timeout_s",
    "redis_timeout_s",
    "lookup_timeout_s",
)
_OFFLOAD_MODES = ("eager", "lazy")
LOOKUP_MODES = ("auto", "probe", "index")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def check_redis_url(url: str) -> None:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("redis_url", url, "must start with redis://, rediss:// or unix://")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ConfigError("redis_url", url, f"has a bad port: {e}") from None
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError("redis_url", url, "a unix:// URL needs a socket path")
        return
    if port == 0:
        raise ConfigError("redis_url", url, "has a bad port: 0")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ConfigError(
            "redis_url", url, f"database {db!r} is not a number (redis://host:port/DB)"
        )


def read_key_file(path: str) -> str:
    """The first line of the key file at ``path``; ``ConfigError`` when it cannot be read."""
    try:
        with open(os.path.expanduser(path)) as f:
            return f.readline().strip()
    except OSError as e:
        raise ConfigError("encryption_key_file", path, f"cannot be read: {e.strerror}") from None


def parse_key(name: str, text: str, shown_as: str | None = None) -> bytes:
    """A 32-byte key from 64 hex digits or base64; ``ConfigError`` (never showing the text)."""
    text = text.strip()
    try:
        key = bytes.fromhex(text) if len(text) == 64 else base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        key = b""
    if len(key) != 32:
        raise ConfigError(
            name,
            shown_as if shown_as is not None else MASK,
            "must be 32 bytes written as 64 hex digits or base64 (e.g. the output "
            "of `openssl rand -hex 32`)",
        )
    return key


def check_backend_options(options: dict[str, Any]) -> None:
    for tier, opts in options.items():
        if not isinstance(tier, str):
            raise ConfigError("backend_options", options, f"backend name {tier!r} is not a string")
        if not isinstance(opts, Mapping):
            raise ConfigError(f"backend_options.{tier}", opts, "must be a mapping of option: value")
        for opt, value in opts.items():
            if not isinstance(opt, str):
                raise ConfigError(
                    f"backend_options.{tier}", dict(opts), f"option name {opt!r} is not a string"
                )
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"backend_options.{tier}.{opt}", value, "must be a finite number")


def check_modes(cfg: KVTierConfig) -> None:
    """``offload`` and ``lookup`` name a mode, and ``lookup: index`` has the loads it needs."""
    if cfg.offload not in _OFFLOAD_MODES:
        raise ConfigError("offload", cfg.offload, f"must be one of {', '.join(_OFFLOAD_MODES)}")
    if cfg.lookup not in LOOKUP_MODES:
        raise ConfigError("lookup", cfg.lookup, f"must be one of {', '.join(LOOKUP_MODES)}")
    if cfg.lookup == "index" and not cfg.loads_async:
        raise ConfigError(
            "lookup",
            cfg.lookup,
            "answers from the index need asynchronous loads (load_async true, use_layerwise false)",
        )


_NON_NEGATIVE = (
    "verify_tolerance",
    "verify_quarantine_s",
    "write_queue_wait_s",
    "consumer_wait_s",
    "sync_load_mb",
)


def check_verify(cfg: KVTierConfig) -> None:
    """The verification fields (``kvtier.core.verify``) and the other durations that may be 0."""
    if not 0 <= cfg.verify_fraction <= 1:
        raise ConfigError("verify_fraction", cfg.verify_fraction, "must be between 0 and 1")
    for name in _NON_NEGATIVE:
        if getattr(cfg, name) < 0:
            raise ConfigError(name, getattr(cfg, name), "must be >= 0")


def both_host_budgets(total: float) -> ConfigError:
    return ConfigError(
        "local_cpu_size_gb_total",
        total,
        "give the host tier's budget per engine or per worker, not both (local_cpu_size_gb is "
        "set too)",
    )


def check_host_budget(cfg: KVTierConfig) -> None:
    """``local_cpu_size_gb_total``: a positive number, and no per-worker size besides it (one
    set to other than its default; ``load_config`` also refuses one set to the default)."""
    total = cfg.local_cpu_size_gb_total
    if total is None:
        return
    if not (isinstance(total, int | float) and math.isfinite(total) and total > 0):
        raise ConfigError("local_cpu_size_gb_total", total, "must be a positive number")
    default = next(f.default for f in fields(cfg) if f.name == "local_cpu_size_gb")
    if cfg.local_cpu_size_gb != default:
        raise both_host_budgets(total)


def check_numbers(cfg: KVTierConfig) -> None:
    """Finite floats; counts, sizes and timeouts that must be positive; rescan intervals."""
    hints = get_type_hints(type(cfg))
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if hints[f.name] is float and not (isinstance(value, int | float) and math.isfinite(value)):
            raise ConfigError(f.name, value, "must be a finite number")
    for name in _POSITIVE_INT:
        if getattr(cfg, name) <= 0:
            raise ConfigError(name, getattr(cfg, name), "must be a positive integer")
    for name in _POSITIVE_FLOAT:
        if getattr(cfg, name) <= 0:
            raise ConfigError(name, getattr(cfg, name), "must be positive")
    for name in ("local_disk_rescan_s", "node_rescan_s"):
        if getattr(cfg, name) < 0:
            raise ConfigError(name, getattr(cfg, name), "must be >= 0 (0 = before every write)")


def validated(cfg: KVTierConfig) -> KVTierConfig:
    """``cfg`` itself once every check passes; else the ``ConfigError`` of the first failure."""
    check_numbers(cfg)
    check_verify(cfg)
    check_host_budget(cfg)
    if cfg.redis_ttl_s < 0:
        raise ConfigError("redis_ttl_s", cfg.redis_ttl_s, "must be >= 0 (0 = no expiry)")
    check_modes(cfg)
    if cfg.log_level.upper() not in _LOG_LEVELS:
        raise ConfigError("log_level", cfg.log_level, f"must be one of {', '.join(_LOG_LEVELS)}")
    if not cfg.tiers:
        raise ConfigError("tiers", cfg.tiers, "needs at least one tier")
    if len(set(cfg.tiers)) != len(cfg.tiers):
        raise ConfigError("tiers", cfg.tiers, "names a tier twice")
    if "redis" in cfg.tiers and not cfg.redis_url:
        raise ConfigError("redis_url", cfg.redis_url, "the redis tier is enabled but has no URL")
    if cfg.redis_url:
        check_redis_url(cfg.redis_url)
    if cfg.encryption_key and cfg.encryption_key_file:
        raise ConfigError(
            "encryption_key_file",
            cfg.encryption_key_file,
            "give the key or a key file, not both (encryption_key is set too)",
        )
    cfg.encryption_key_bytes()  # a bad key, or an unreadable key file, fails here
    check_backend_options(cfg.backend_options)
    return cfg

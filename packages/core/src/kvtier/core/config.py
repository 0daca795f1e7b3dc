"""kvtier configuration: a YAML file, ``KVTIER_*`` environment variables over it, and a dict over
those (what vLLM's ``kv_connector_extra_config`` passes).

Every field is declared once below with its type, default and meaning; the README's config
reference is generated from the same table (``python -m kvtier.core.config``). Unknown keys and
bad values raise ``ConfigError`` naming the field and the value (secrets masked: the Redis
password, and the password inside a Redis URL, never appear in an error or in ``repr``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from kvtier.core.errors import ConfigError

ENV_PREFIX = "KVTIER_"
ENV_CONFIG_FILE = "KVTIER_CONFIG_FILE"
KNOWN_TIERS_DOC = "local_cpu, local_disk, redis (or any name registered in kvtier.backends)"


_MASK = "***"


def mask_url(url: str) -> str:
    """``url`` with the password of its user-info part replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return _MASK
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:{_MASK}@{host}"))


def shown(name: str, value: Any) -> Any:
    """``value`` as an error or ``repr`` may show it: secrets masked."""
    if value is None:
        return None
    if "password" in name or "secret" in name or name == "encryption_key":
        return _MASK
    if "url" in name and isinstance(value, str):
        return mask_url(value)
    return value


def _error(name: str, value: Any, reason: str) -> ConfigError:
    return ConfigError(name, shown(name, value), reason)


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvtier")


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"doc": text}, **kw)


@dataclass(frozen=True)
class KVTierConfig:
    """All of kvtier's settings. Build one with ``load_config``."""

    chunk_size: int = _doc("Tokens per chunk (a multiple of the engine's block size).", default=256)
    platform: str | None = _doc(
        "Platform to use (cpu, cuda, xpu, ...); empty = the available one with the highest priority.",
        default=None,
    )
    plugins: list[str] | None = _doc(
        "Allow-list of platform/backend entry-point names to load; empty = all.", default=None
    )
    tiers: list[str] = _doc(
        f"Storage tiers, fastest first: {KNOWN_TIERS_DOC}.",
        default_factory=lambda: ["local_cpu", "local_disk"],
    )
    local_cpu_size_gb: float = _doc(
        "Host-memory tier budget (GiB); the host arena size.", default=2.0
    )
    pin_memory: bool = _doc("Pin the host arena where the platform can (CUDA, XPU).", default=True)
    local_disk_path: str = _doc(
        "Disk tier directory (default: $XDG_CACHE_HOME/kvtier/disk, else ~/.cache/kvtier/disk).",
        default="",
    )
    local_disk_size_gb: float = _doc("Disk tier budget (GiB).", default=16.0)
    local_disk_o_direct: bool = _doc("Read and write disk-tier files with O_DIRECT.", default=False)
    redis_url: str | None = _doc(
        "Redis/Valkey URL: redis://host:port/db, rediss:// (TLS), unix:///path.sock.", default=None
    )
    redis_cluster: bool = _doc("Treat redis_url as a Redis Cluster node.", default=False)
    redis_username: str | None = _doc("Redis ACL user name.", default=None)
    redis_password: str | None = _doc("Redis password.", default=None)
    redis_ttl_s: int = _doc("Expire Redis entries after this many seconds; 0 = never.", default=0)
    redis_connect_timeout_s: float = _doc("Redis connect timeout (s).", default=1.0)
    redis_timeout_s: float = _doc(
        "Deadline of each Redis round trip (at most two a call), plus its bytes at "
        "min_throughput_mb_s (s).",
        default=2.0,
    )
    write_queue_size: int = _doc(
        "Pending writes to lower tiers; when full a lower-tier copy is dropped (counted).",
        default=256,
    )
    io_threads: int = _doc("Threads serving lower-tier reads and writes.", default=4)
    save_unfull_chunk: bool = _doc(
        "Also store a prompt's trailing partial chunk (block-aligned), so a repeat recomputes "
        "less than a chunk.",
        default=True,
    )
    save_decode_cache: bool = _doc("Also store chunks filled by generated tokens.", default=False)
    store_threshold: int = _doc(
        "Store a chunk only once this many requests have contained it (1: the first time); "
        "one-off prompts then cost no copies.",
        default=1,
    )
    offload: str = _doc(
        "vLLM: when a computed chunk is copied off the device. eager: as soon as it is "
        "computed. lazy: only when vLLM is about to evict its blocks from its prefix cache (a "
        "prompt vLLM keeps cached moves no bytes); needs vLLM's prefix caching.",
        default="eager",
    )
    use_layerwise: bool = _doc(
        "Load/store layer by layer, overlapping with the forward pass.", default=False
    )
    load_async: bool = _doc(
        "vLLM: load a hit on a worker thread while other requests run (the request waits in WAITING_FOR_REMOTE_KVS); False loads before the forward pass. Layer-wise loads are always synchronous.",
        default=True,
    )
    device_staging_buffer: bool = _doc(
        "XPU: gather a layer into a device buffer, then one copy to host (layer-wise); CUDA: False moves KV by kernels reading/writing pinned host memory (zerocopy) instead of staging slots + copy engines.",
        default=True,
    )
    encryption_key: str | None = _doc(
        "Seal every payload written to disk or Redis with AES-256-GCM, under a key per cache "
        "salt derived from this one: 32 bytes as 64 hex digits or base64. Empty = off. A tier "
        "that cannot seal (a third-party tier without seals_payloads) is refused while it is "
        "set. Needs kvtier[encryption].",
        default=None,
    )
    encryption_key_file: str | None = _doc(
        "A file holding encryption_key (its first line); keep it mode 0600.", default=None
    )
    lookup_timeout_s: float = _doc(
        "How long a waiting request's lookup (a probe of every tier on the workers) may take "
        "before it counts as a miss (s); the scheduler never waits for it.",
        default=2.0,
    )
    log_level: str = _doc("Log level of the kvtier logger.", default="WARNING")
    backend_options: dict[str, Any] = _doc(
        "Per-backend options for third-party tiers: {backend name: {option: value}}.",
        default_factory=dict,
    )

    def __post_init__(self) -> None:
        _validated(self)  # however it is built (load_config, replace, the constructor)

    def __repr__(self) -> str:
        body = ", ".join(f"{f.name}={shown(f.name, getattr(self, f.name))!r}" for f in fields(self))
        return f"KVTierConfig({body})"

    def encryption_key_bytes(self) -> bytes | None:
        """The 32-byte encryption key (from ``encryption_key`` or its file); None when off."""
        if self.encryption_key:
            return _parse_key("encryption_key", self.encryption_key)
        if self.encryption_key_file:
            return _parse_key(
                "encryption_key_file",
                _read_key_file(self.encryption_key_file),
                shown_as=self.encryption_key_file,
            )
        return None

    def disk_path(self) -> Path:
        return Path(self.local_disk_path or os.path.join(default_cache_dir(), "disk")).expanduser()

    def replace(self, **changes: Any) -> KVTierConfig:
        return _validated(dataclasses.replace(self, **changes))


_POSITIVE_INT = ("chunk_size", "write_queue_size", "io_threads", "store_threshold")
_POSITIVE_FLOAT = (
    "local_cpu_size_gb",
    "local_disk_size_gb",
    "redis_connect_timeout_s",
    "redis_timeout_s",
    "lookup_timeout_s",
)
_OFFLOAD_MODES = ("eager", "lazy")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _check_redis_url(url: str) -> None:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise _error("redis_url", url, "must start with redis://, rediss:// or unix://")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise _error("redis_url", url, f"has a bad port: {e}") from None
    if parts.scheme == "unix":
        if not parts.path:
            raise _error("redis_url", url, "a unix:// URL needs a socket path")
        return
    if port == 0:
        raise _error("redis_url", url, "has a bad port: 0")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise _error("redis_url", url, f"database {db!r} is not a number (redis://host:port/DB)")


def _read_key_file(path: str) -> str:
    try:
        with open(os.path.expanduser(path)) as f:
            return f.readline().strip()
    except OSError as e:
        raise ConfigError("encryption_key_file", path, f"cannot be read: {e.strerror}") from None


def _parse_key(name: str, text: str, shown_as: str | None = None) -> bytes:
    """A 32-byte key from 64 hex digits or base64; ``ConfigError`` (never showing the text)."""
    text = text.strip()
    try:
        key = bytes.fromhex(text) if len(text) == 64 else base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        key = b""
    if len(key) != 32:
        raise ConfigError(
            name,
            shown_as if shown_as is not None else _MASK,
            "must be 32 bytes written as 64 hex digits or base64 (e.g. the output "
            "of `openssl rand -hex 32`)",
        )
    return key


def _check_backend_options(options: dict[str, Any]) -> None:
    for tier, opts in options.items():
        if not isinstance(tier, str):
            raise _error("backend_options", options, f"backend name {tier!r} is not a string")
        if not isinstance(opts, Mapping):
            raise _error(f"backend_options.{tier}", opts, "must be a mapping of option: value")
        for opt, value in opts.items():
            if not isinstance(opt, str):
                raise _error(
                    f"backend_options.{tier}", dict(opts), f"option name {opt!r} is not a string"
                )
            if isinstance(value, float) and not math.isfinite(value):
                raise _error(f"backend_options.{tier}.{opt}", value, "must be a finite number")


def _validated(cfg: KVTierConfig) -> KVTierConfig:
    hints = _hints()
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if hints[f.name] is float and not (isinstance(value, int | float) and math.isfinite(value)):
            raise _error(f.name, value, "must be a finite number")
    for name in _POSITIVE_INT:
        if getattr(cfg, name) <= 0:
            raise _error(name, getattr(cfg, name), "must be a positive integer")
    for name in _POSITIVE_FLOAT:
        if getattr(cfg, name) <= 0:
            raise _error(name, getattr(cfg, name), "must be positive")
    if cfg.redis_ttl_s < 0:
        raise ConfigError("redis_ttl_s", cfg.redis_ttl_s, "must be >= 0 (0 = no expiry)")
    if cfg.offload not in _OFFLOAD_MODES:
        raise ConfigError("offload", cfg.offload, f"must be one of {', '.join(_OFFLOAD_MODES)}")
    if cfg.log_level.upper() not in _LOG_LEVELS:
        raise ConfigError("log_level", cfg.log_level, f"must be one of {', '.join(_LOG_LEVELS)}")
    if not cfg.tiers:
        raise ConfigError("tiers", cfg.tiers, "needs at least one tier")
    if len(set(cfg.tiers)) != len(cfg.tiers):
        raise ConfigError("tiers", cfg.tiers, "names a tier twice")
    if "redis" in cfg.tiers and not cfg.redis_url:
        raise ConfigError("redis_url", cfg.redis_url, "the redis tier is enabled but has no URL")
    if cfg.redis_url:
        _check_redis_url(cfg.redis_url)
    if cfg.encryption_key and cfg.encryption_key_file:
        raise _error(
            "encryption_key_file",
            cfg.encryption_key_file,
            "give the key or a key file, not both (encryption_key is set too)",
        )
    cfg.encryption_key_bytes()  # a bad key, or an unreadable key file, fails here
    _check_backend_options(cfg.backend_options)
    return cfg


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Turn ``value`` (from YAML, env text, or a dict) into the field's type, or raise."""
    origin, args = get_origin(hint), get_args(hint)
    if args and type(None) in args:  # Optional[X]
        if value is None or (
            isinstance(value, str) and value.strip().lower() in ("", "none", "null")
        ):
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0])
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise _error(name, value, "must be a boolean (true/false)")
    if hint is int:
        if isinstance(value, bool):
            raise _error(name, value, "must be an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise _error(name, value, "must be an integer")
    if hint is float:
        if isinstance(value, bool):
            raise _error(name, value, "must be a number")
        number: float | None = None
        if isinstance(value, int | float):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                pass
        if number is None:
            raise _error(name, value, "must be a number")
        if not math.isfinite(number):
            raise _error(name, value, "must be a finite number")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        raise _error(name, value, "must be a string")
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise _error(name, value, "must be a list (or a comma-separated string)")
        return [_coerce(name, v, args[0]) for v in value]
    if origin is dict:
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as e:
                raise _error(name, value, f"is not a YAML/JSON mapping: {e}") from None
        if not isinstance(value, Mapping):
            raise _error(name, value, "must be a mapping")
        return dict(value)
    raise _error(name, value, f"has an unsupported type {hint}")


def _hints() -> dict[str, Any]:
    return get_type_hints(KVTierConfig)


def _apply(source: str, raw: Mapping[str, Any], into: dict[str, Any]) -> None:
    hints = _hints()
    for key, value in raw.items():
        if key not in hints:
            raise _error(key, value, f"unknown key (from {source}); known keys: {', '.join(hints)}")
        into[key] = _coerce(key, value, hints[key])


def env_overrides(env: Mapping[str, str]) -> dict[str, str]:
    """``KVTIER_<FIELD>`` variables as ``{field: text}`` (KVTIER_CONFIG_FILE is not a field)."""
    known = {f.name for f in fields(KVTierConfig)}
    out: dict[str, str] = {}
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG_FILE:
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name in known:
            out[name] = text
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> KVTierConfig:
    """Defaults < YAML file (``path`` or ``$KVTIER_CONFIG_FILE``) < ``KVTIER_*`` env < ``overrides``.

    Environment variables that start with ``KVTIER_`` but name no field are ignored (other kvtier
    tools use the prefix too); unknown keys in the file or the dict are errors.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    file_path = path or env.get(ENV_CONFIG_FILE)
    if file_path:
        try:
            with open(file_path) as f:
                data = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError("config_file", str(file_path), f"cannot be read: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError("config_file", str(file_path), f"is not valid YAML: {e}") from None
        if not isinstance(data, Mapping):
            raise ConfigError("config_file", str(file_path), "must hold a YAML mapping")
        _apply(f"file {file_path}", data, values)
    _apply("environment", env_overrides(env), values)
    if overrides:
        _apply("overrides", overrides, values)
    return _validated(KVTierConfig(**values))


def reference_table() -> str:
    """The README's config reference, in Markdown."""
    hints = _hints()
    rows = ["| key | env | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for f in fields(KVTierConfig):
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[operator]
        type_name = str(hints[f.name]).replace("typing.", "")
        # on 3.10 a generic alias such as list[str] is also a ``type``
        if isinstance(hints[f.name], type) and get_origin(hints[f.name]) is None:
            type_name = hints[f.name].__name__
        type_name = type_name.replace(" | ", " or ")
        rows.append(
            f"| `{f.name}` | `{ENV_PREFIX}{f.name.upper()}` | {type_name} | `{default!r}` | "
            f"{f.metadata['doc']} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_table())

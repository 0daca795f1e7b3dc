"""kvtier configuration: a YAML file, ``KVTIER_*`` environment variables over it, and a dict over
those (what vLLM's ``kv_connector_extra_config`` passes).

Every field is declared once below with its type, default and meaning; the config reference
(docs/configuration.md) is generated from the same table (``python -m kvtier.core.config``).
Unknown keys and bad values raise ``ConfigError`` naming the field and the value (secrets
masked: the Redis password, and the password inside a Redis URL, never appear in an error or in
``repr``).
Each value is turned into its field's type by ``kvtier.core.config.coerce`` and the whole config
is checked by ``kvtier.core.config.checks``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import yaml

from kvtier.core.config.checks import both_host_budgets, parse_key, read_key_file, validated
from kvtier.core.config.coerce import coerce
from kvtier.core.config.masking import mask_url, shown
from kvtier.core.errors import ConfigError

__all__ = [
    "ENV_CONFIG_FILE",
    "ENV_PREFIX",
    "KNOWN_TIERS_DOC",
    "KVTierConfig",
    "default_cache_dir",
    "env_overrides",
    "load_config",
    "mask_url",
    "reference_table",
    "shown",
]

ENV_PREFIX = "KVTIER_"
ENV_CONFIG_FILE = "KVTIER_CONFIG_FILE"
KNOWN_TIERS_DOC = "local_cpu, node, local_disk, redis (or any name registered in kvtier.backends)"


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvtier")


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"doc": text}, **kw)


@dataclass(frozen=True)
class KVTierConfig:
    """All of kvtier's settings. Build one with ``load_config``."""

    chunk_size: int = _doc(
        "Tokens per chunk (a multiple of the engine's block size; the default 256 becomes the "
        "next multiple where vLLM's block size does not divide it, and a Mamba hybrid's "
        "block size, which vLLM raises so one block holds a state).",
        default=256,
    )
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
        "Host-memory tier budget (GiB) of each worker process (every tensor-parallel rank has "
        "its own); the host arena size.",
        default=2.0,
    )
    local_cpu_size_gb_total: float | None = _doc(
        "Host-memory tier budget (GiB) of the whole engine, split evenly over its worker "
        "processes (tensor x pipeline parallel size), as vLLM's cpu_bytes_to_use is; instead of "
        "local_cpu_size_gb (setting both is an error). Empty = local_cpu_size_gb per worker.",
        default=None,
    )
    pin_memory: bool = _doc("Pin the host arena where the platform can (CUDA, XPU).", default=True)
    local_disk_path: str = _doc(
        "Disk tier directory (default: $XDG_CACHE_HOME/kvtier/disk, else ~/.cache/kvtier/disk).",
        default="",
    )
    local_disk_size_gb: float = _doc(
        "Disk tier budget (GiB) of each worker process (every tensor-parallel rank has its own); "
        "processes serving the same model and rank from one local_disk_path share it.",
        default=16.0,
    )
    local_disk_rescan_s: float = _doc(
        "How often (s, at most) the disk tier rescans its directory before writing, to count "
        "the files other processes sharing it wrote or deleted; 0 = before every write.",
        default=10.0,
    )
    local_disk_o_direct: bool = _doc("Read and write disk-tier files with O_DIRECT.", default=False)
    local_disk_shared: bool = _doc(
        "Other running engines write local_disk_path too (a directory shared by instances): "
        "lookups probe the disk tier for what they wrote since this engine started, instead of "
        "answering from this engine's index of it.",
        default=False,
    )
    node_path: str = _doc(
        "Node tier directory, on a memory file system (tmpfs, ramfs); every kvtier process "
        "of this user on the host that names it shares it (default: /dev/shm/kvtier-<uid>).",
        default="",
    )
    node_size_gb: float = _doc(
        "Node tier budget (GiB) of the whole host: every process, model and rank using node_path "
        "shares it, the least recently used chunks evicted first.",
        default=4.0,
    )
    node_rescan_s: float = _doc(
        "How often (s, at most) a process rescans the node tier before writing, to count what "
        "the others wrote and evict across them; 0 = before every write.",
        default=1.0,
    )
    redis_url: str | None = _doc(
        "Redis/Valkey URL: redis://host:port/db, rediss:// (TLS), unix:///path.sock.", default=None
    )
    redis_cluster: bool = _doc("Treat redis_url as a Redis Cluster node.", default=False)
    redis_username: str | None = _doc("Redis ACL user name.", default=None)
    redis_password: str | None = _doc("Redis password.", default=None)
    redis_ttl_s: int = _doc("Expire Redis entries after this many seconds; 0 = never.", default=0)
    redis_connect_timeout_s: float = _doc("Redis connect timeout (s).", default=1.0)
    redis_timeout_s: float = _doc(
        "Deadline of a whole Redis call, plus its bytes at min_throughput_mb_s (s); a read's "
        "heads get half of it.",
        default=2.0,
    )
    write_queue_size: int = _doc(
        "Pending writes to lower tiers; when full a lower-tier copy is dropped (counted).",
        default=256,
    )
    write_queue_wait_s: float = _doc(
        "How long a chunk saved while the lower-tier write queue is full may wait, queued "
        "past write_queue_size (up to as many again), for a writer before that copy is dropped "
        "(s); 0 = dropped at once. The save itself never waits. A vLLM kv_producer uses at "
        "least 10 s (its chunks are another instance's input).",
        default=0.0,
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
        "vLLM: load a hit on a worker thread while other requests run (the request waits in WAITING_FOR_REMOTE_KVS; a short hit already in host memory loads before the forward pass all the same: sync_load_mb); False loads every hit before the forward pass. Layer-wise loads are always synchronous.",
        default=True,
    )
    sync_load_mb: float = _doc(
        "vLLM, with load_async: a hit already in host memory is loaded before the forward pass "
        "of the step that schedules its request (no step spent waiting, as with vLLM's own "
        "prefix cache) while that step's such loads add up to at most this many MiB per rank; "
        "larger hits, and hits still being saved or in lower tiers, load on the worker's thread. "
        "0 = every hit on the thread.",
        default=128.0,
    )
    device_staging_buffer: bool = _doc(
        "Keep the device staging memory of the CUDA and XPU movers between calls (False: "
        "allocated per call and released after it; the copies are the same). No effect on CPU.",
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
    lookup: str = _doc(
        "vLLM: how a waiting request's hit is confirmed. probe: the workers look the prompt up "
        "and hold its chunks until the load (one scheduler step; a hit is never lost). index: a "
        "hit the scheduler's index of stored chunks knows is answered at once, without a hold "
        "(loaded as load_async and sync_load_mb say); a chunk gone by the load is recomputed (needs vLLM's "
        "kv_load_failure_policy='recompute' and load_async; with a Redis tier prompts are still "
        "probed). auto: index where it can run, else probe.",
        default="auto",
    )
    lookup_timeout_s: float = _doc(
        "How long a waiting request's lookup (a probe of every tier on the workers) may take "
        "before it counts as a miss (s); the scheduler never waits for it.",
        default=2.0,
    )
    consumer_wait_s: float = _doc(
        "vLLM kv_consumer: how long a request whose kv_transfer_params announce a producer's "
        "chunks waits for them to be readable in the shared tiers before it is served with "
        "what is there (s); the scheduler never blocks meanwhile.",
        default=10.0,
    )
    verify_fraction: float = _doc(
        "vLLM: the fraction of requests with a kvtier hit that are verified: told there is no "
        "hit, so vLLM computes the prefix, whose pages are then compared with the stored chunks; "
        "a wrong chunk is removed from every tier and its tier quarantined "
        "(docs/verification.md). 0 = off.",
        default=0.01,
    )
    verify_max_tokens: int = _doc(
        "vLLM: only a request whose hit is at most this many tokens is sampled for "
        "verification (what one verification may cost in extra prefill).",
        default=4096,
    )
    verify_tolerance: float = _doc(
        "Largest page error (mean abs(stored - fresh) / mean abs(fresh) over one layer's block) "
        "taken for rounding; 0 = the measured default of the cache's dtype (docs/verification.md).",
        default=0.0,
    )
    verify_quarantine_s: float = _doc(
        "How long a tier that served a wrong chunk answers every read with a miss (s).",
        default=300.0,
    )
    log_level: str = _doc(
        "Log level of the kvtier logger (DEBUG: a line per request decision, by request id).",
        default="WARNING",
    )
    backend_options: dict[str, Any] = _doc(
        "Per-tier options ({tier name: {option: value}}) for tiers in `tiers` that take them: "
        "redis and third-party tiers.",
        default_factory=dict,
    )

    def __post_init__(self) -> None:
        # However it is built (load_config, replace, the constructor): the same coercion and
        # checks, so ``KVTierConfig(chunk_size="64")`` is 64 and ``verify_fraction=True`` an error.
        hints = _hints()
        for f in fields(self):
            object.__setattr__(self, f.name, coerce(f.name, getattr(self, f.name), hints[f.name]))
        validated(self)

    def __repr__(self) -> str:
        body = ", ".join(f"{f.name}={shown(f.name, getattr(self, f.name))!r}" for f in fields(self))
        return f"KVTierConfig({body})"

    def encryption_key_bytes(self) -> bytes | None:
        """The 32-byte encryption key (from ``encryption_key`` or its file); None when off."""
        if self.encryption_key:
            return parse_key("encryption_key", self.encryption_key)
        if self.encryption_key_file:
            return parse_key(
                "encryption_key_file",
                read_key_file(self.encryption_key_file),
                shown_as=self.encryption_key_file,
            )
        return None

    @property
    def loads_async(self) -> bool:
        """Whether vLLM hits are loaded on a worker thread: ``load_async``, unless loads are
        layer-wise (those run inside the forward pass, always synchronously)."""
        return self.load_async and not self.use_layerwise

    def disk_path(self) -> Path:
        return Path(self.local_disk_path or os.path.join(default_cache_dir(), "disk")).expanduser()

    def node_dir(self) -> Path:
        return Path(self.node_path or f"/dev/shm/kvtier-{os.getuid()}").expanduser()

    def replace(self, **changes: Any) -> KVTierConfig:
        return validated(dataclasses.replace(self, **changes))

    def per_worker(self, world_size: int) -> KVTierConfig:
        """This config as one of ``world_size`` workers runs it: ``local_cpu_size_gb_total``
        split evenly into ``local_cpu_size_gb`` (unchanged when no total is set)."""
        if self.local_cpu_size_gb_total is None:
            return self
        share = self.local_cpu_size_gb_total / max(1, world_size)
        return self.replace(local_cpu_size_gb=share, local_cpu_size_gb_total=None)


@functools.cache
def _hints() -> dict[str, Any]:
    return get_type_hints(KVTierConfig)


def _apply(source: str, raw: Mapping[str, Any], into: dict[str, Any]) -> None:
    hints = _hints()
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(
                key, value, f"unknown key (from {source}); known keys: {', '.join(hints)}"
            )
        into[key] = coerce(key, value, hints[key])


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
        except UnicodeDecodeError:
            raise ConfigError("config_file", str(file_path), "is not UTF-8 text (YAML)") from None
        except yaml.YAMLError as e:
            raise ConfigError("config_file", str(file_path), f"is not valid YAML: {e}") from None
        if not isinstance(data, Mapping):
            raise ConfigError("config_file", str(file_path), "must hold a YAML mapping")
        _apply(f"file {file_path}", data, values)
    _apply("environment", env_overrides(env), values)
    if overrides:
        _apply("overrides", overrides, values)
    if values.get("local_cpu_size_gb_total") is not None and "local_cpu_size_gb" in values:
        raise both_host_budgets(values["local_cpu_size_gb_total"])
    return validated(KVTierConfig(**values))


def reference_table() -> str:
    """The config reference of docs/configuration.md, in Markdown."""
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

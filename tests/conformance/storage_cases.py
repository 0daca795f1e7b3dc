"""What the storage backend conformance suite runs against: every tier kvtier ships, and a
third-party tier written as a plugin would write one (``DictBackend``), each with a handle on its
medium (``Medium``) so the tests can damage stored values the way a disk or a network would.

Backends are built the way the manager builds them: the class registered under the tier's name
in the ``kvtier.backends`` entry-point group, and one ``BackendContext``.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvtier.core.config import KVTierConfig, load_config
from kvtier.core.keys import ChunkKey, KeyFactory
from kvtier.core.layout import KVLayout
from kvtier.core.memory import MemoryObj, MemoryObjMeta
from kvtier.storage import codec
from kvtier.storage.backends.base import StorageBackend

LAYOUT = KVLayout(
    num_layers=2,
    num_kv_heads=2,
    head_size=8,
    dtype="float16",
    # Blocks of one token: any token count is whole pages, so partial chunks of any length test
    # the tiers (chunks of real engines are whole blocks of 16 or more).
    block_size=1,
    paged_layout="LBHNC",
)
CHUNK = 16
KEYS = KeyFactory("conformance-model", LAYOUT.fingerprint())
NAMESPACE = KEYS.key(b"").namespace()
OTHER_KEYS = KeyFactory("another-model", LAYOUT.fingerprint())
OTHER_NAMESPACE = OTHER_KEYS.key(b"").namespace()


def key(i: int) -> ChunkKey:
    return KEYS.key(i.to_bytes(16, "little"))


def other_key(i: int) -> ChunkKey:
    """Chunk ``i``'s key for another model: the same token hash, another namespace."""
    return OTHER_KEYS.key(i.to_bytes(16, "little"))


def meta(tokens: int = CHUNK) -> MemoryObjMeta:
    return MemoryObjMeta(LAYOUT.chunk_shape(tokens), LAYOUT.chunk_dtype, tokens)


def chunk_value(i: int, tokens: int = CHUNK) -> torch.Tensor:
    """Distinct random bytes for chunk ``i`` (bit patterns, not values: NaNs included)."""
    g = torch.Generator().manual_seed(1000 + i)
    n = meta(tokens).nbytes
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(
        LAYOUT.chunk_shape(tokens)
    )


def config(tmp_path: Path, **kw: Any) -> KVTierConfig:
    base: dict[str, Any] = {
        "local_disk_path": str(tmp_path / "disk"),
        "chunk_size": CHUNK,
        "redis_timeout_s": 2.0,
        "redis_connect_timeout_s": 1.0,
    }
    base.update(kw)
    return load_config(overrides=base, env={})


logger = logging.getLogger("kvtier.dict_tier")


# -- a third-party tier ------------------------------------------------------------------------
# What a plugin's "server" holds: medium id -> stored name -> value (shared by every instance
# built with the same ``medium`` option, as engines share a Redis).
MEDIA: dict[int, dict[str, bytes]] = {}


class DictBackend(StorageBackend):
    """A minimal third-party tier: serialized values (kvtier's codec: header, key and checksum)
    in a process-wide dict. Option ``medium`` (a number) picks the dict."""

    name: ClassVar[str] = "dict_tier"

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.store = MEDIA.setdefault(int(ctx.options.get("medium", 0)), {})
        self._lock = threading.Lock()

    def _name(self, key: ChunkKey) -> str:
        return f"{self.ctx.namespace}/{key.to_string()}"

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [self._name(k) in self.store for k in keys]

    def batched_put(self, items: Sequence[tuple[ChunkKey, MemoryObj]]) -> None:
        for k, obj in items:
            payload = obj.byte_view()
            header, trailer = codec.encode(k, obj.meta, self.ctx.layout, payload)
            value = header + bytes(payload) + trailer
            with self._lock:
                self.store[self._name(k)] = value

    def batched_get(
        self, keys: Sequence[ChunkKey], allocate: Callable[[MemoryObjMeta], MemoryObj | None]
    ) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = []
        for k in keys:
            with self._lock:
                value = self.store.get(self._name(k))
            obj = None
            if value is not None:
                try:
                    obj = codec.decode_into_object(
                        value,
                        key=k,
                        layout=self.ctx.layout,
                        max_tokens=self.ctx.config.chunk_size,
                        allocate=allocate,
                    )
                except codec.PayloadError as e:
                    logger.warning("kvtier: dict_tier value of %s rejected: %s", k.digest(), e)
                    self.ctx.stats.add(f"{self.name}.corrupt")
                    self.remove([k])
            out.append(obj)
        return out

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for k in keys:
                self.store.pop(self._name(k), None)


# -- media: raw access to what a tier stored ---------------------------------------------------
class Medium:
    """The raw stored values of one tier: ``names()`` of what is there now, ``read``/``write``."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def read(self, name: str) -> bytes:
        raise NotImplementedError

    def write(self, name: str, value: bytes) -> None:
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError


class DiskMedium(Medium):
    def __init__(self, root: Path) -> None:
        from kvtier.storage.backends.disk.local_disk import SUFFIX

        self.root, self.suffix = root, SUFFIX

    def names(self) -> list[str]:
        return sorted(str(p) for p in self.root.rglob(f"*{self.suffix}"))

    def read(self, name: str) -> bytes:
        return Path(name).read_bytes()

    def write(self, name: str, value: bytes) -> None:
        Path(name).write_bytes(value)

    def delete(self, name: str) -> None:
        Path(name).unlink()


class RedisMedium(Medium):
    """A server's values, read and damaged through kvtier's own RESP connection."""

    def __init__(self, url: str) -> None:
        from fixtures.redis_client import RedisClient

        self.client = RedisClient(url)

    def names(self) -> list[str]:
        return sorted(k.decode() for k in self.client.keys("*"))

    def read(self, name: str) -> bytes:
        value = self.client.get(name)
        assert value is not None
        return bytes(value)

    def write(self, name: str, value: bytes) -> None:
        self.client.set(name, value)

    def delete(self, name: str) -> None:
        self.client.delete(name)


class DictMedium(Medium):
    def __init__(self, store: dict[str, bytes]) -> None:
        self.store = store

    def names(self) -> list[str]:
        return sorted(self.store)

    def read(self, name: str) -> bytes:
        return self.store[name]

    def write(self, name: str, value: bytes) -> None:
        self.store[name] = value

    def delete(self, name: str) -> None:
        del self.store[name]


def flip(value: bytes, at: int) -> bytes:
    b = bytearray(value)
    b[at % len(b)] ^= 0x40
    return bytes(b)


# How a stored value is damaged: every value stored for the chunk gets the same treatment.
DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "payload_byte": lambda v: flip(v, len(v) - 9),
    "header_byte": lambda v: flip(v, 30),
    "first_byte": lambda v: flip(v, 0),
    "truncated": lambda v: v[: len(v) - 100],
    "extended": lambda v: v + b"\0" * 64,
    "empty": lambda v: b"",
    "crc32_of_garbage": lambda v: zlib.crc32(v).to_bytes(4, "little") * 8,
}

"""Shared pieces of the storage tests: a small layout, keys, chunks with known contents."""

from __future__ import annotations

from typing import Any

import torch

from kvtier.core.config import load_config
from kvtier.core.keys import ChunkKey, KeyFactory
from kvtier.core.layout import KVLayout
from kvtier.core.memory import MemoryObj, MemoryObjMeta
from kvtier.storage.manager import TieredStorageManager

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
KEYS = KeyFactory("test-model", LAYOUT.fingerprint())
NAMESPACE = KEYS.key(b"").namespace()


def key(i: int, factory: KeyFactory = KEYS) -> ChunkKey:
    return factory.key(i.to_bytes(16, "little"))


def meta(tokens: int = CHUNK) -> MemoryObjMeta:
    return MemoryObjMeta(LAYOUT.chunk_shape(tokens), LAYOUT.chunk_dtype, tokens)


def chunk_value(i: int, tokens: int = CHUNK) -> torch.Tensor:
    """Distinct, position-dependent contents for chunk ``i``."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, 256, LAYOUT.chunk_shape(tokens), dtype=torch.uint8, generator=g)


def put_chunk(m: TieredStorageManager, i: int, tokens: int = CHUNK) -> None:
    obj = m.allocate(meta(tokens))
    assert obj is not None
    with obj:
        obj.tensor.copy_(chunk_value(i, tokens))
        m.put(key(i), obj)


def check_obj(obj: MemoryObj | None, i: int) -> None:
    assert obj is not None, f"chunk {i} missed"
    assert torch.equal(obj.tensor, chunk_value(i, obj.num_tokens)), f"chunk {i} has wrong bytes"


def config(tmp_path, **kw: Any):
    base: dict[str, Any] = {
        "tiers": ["local_cpu", "local_disk"],
        "local_disk_path": str(tmp_path / "disk"),
        "chunk_size": CHUNK,
        "io_threads": 2,
        "redis_timeout_s": 0.5,
        "redis_connect_timeout_s": 0.5,
    }
    base.update(kw)
    return load_config(overrides=base, env={})


ARENA_BYTES = 64 * meta().nbytes


def disk_of(m: TieredStorageManager) -> Any:
    """The manager's one lower tier (tests built with a disk tier only)."""
    (disk,) = m.lower
    return disk


def stored(m: TieredStorageManager, *idx: int) -> None:
    """Chunks ``idx`` flushed to the lower tier and gone from host memory (reads hit the disk)."""
    for i in idx:
        put_chunk(m, i)
    assert m.flush(10), m.last_flush
    m.host.remove([key(i) for i in idx])

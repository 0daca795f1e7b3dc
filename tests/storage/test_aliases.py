"""Aliases (``kvtier.core.keys.aliases``) through every tier's ordinary put/get path: a prompt that
diverges inside a stored full chunk hits every whole block it shares from disk after a restart,
from Redis in another engine, sealed or not; a corrupt, foreign or dangling alias is a miss,
never wrong KV; aliases ride in their chunk's write-queue slot."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures.tiered_engine import BLOCK, CHUNK, LAYOUT, caches, per_slot, tiered_engine
from kvtier.core import CacheEngine
from kvtier.core.keys import ChunkKey
from kvtier.core.keys.aliases import alias_meta
from kvtier.core.memory import MemoryObjMeta
from kvtier.storage import codec

NUM_BLOCKS = 48
DOC = list(range(1000, 1000 + 3 * CHUNK))  # the stored prompt: 3 full chunks


def engine(path, **cfg) -> CacheEngine:
    return tiered_engine(path, **{"save_unfull_chunk": False, **cfg})


def store_doc(path, **cfg) -> list[torch.Tensor]:
    """Store DOC from one engine (slots 0..), flush the lower tiers, close it; its caches."""
    src = caches(0, NUM_BLOCKS)
    a = engine(path, **cfg)
    try:
        a.register_kv_caches(src)
        assert a.store(DOC, torch.arange(len(DOC))) == len(DOC)
        assert a.storage.flush(30), a.storage.last_flush
    finally:
        a.close()
    return src


def load_in_fresh_engine(path, tokens: list[int], src, **cfg) -> int:
    """Look ``tokens`` up in a new engine, load them into zeroed caches at slots shifted by one
    chunk, check the loaded KV is DOC's of the same positions; the hit."""
    b = engine(path, **cfg)
    try:
        dst = caches(None, NUM_BLOCKS)
        b.register_kv_caches(dst)
        n = b.lookup(tokens)
        slots = torch.arange(len(tokens)) + CHUNK
        mask = b.retrieve(tokens, slots)
        assert int(mask.sum()) == n
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(
                per_slot(d)[CHUNK : CHUNK + n].view(torch.uint8),
                per_slot(s)[:n].view(torch.uint8),
            )
            assert not per_slot(d)[CHUNK + n :].any()
        return n
    finally:
        b.close()


def diverging(at: int) -> list[int]:
    return DOC[:at] + [7] * CHUNK


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(at=st.integers(1, 3 * CHUNK - 1))
def test_disk_after_a_restart_hits_every_shared_block(tmp_path_factory, at: int) -> None:
    path = tmp_path_factory.mktemp("disk")
    src = store_doc(path, tiers=["local_cpu", "local_disk"])
    hit = load_in_fresh_engine(path, diverging(at), src, tiers=["local_cpu", "local_disk"])
    assert hit == at - at % BLOCK


def test_sealed_aliases_on_disk(tmp_path) -> None:
    pytest.importorskip("cryptography")
    cfg = {"tiers": ["local_cpu", "local_disk"], "encryption_key": "11" * 32}
    src = store_doc(tmp_path, **cfg)
    assert load_in_fresh_engine(tmp_path, diverging(CHUNK + 3 * BLOCK), src, **cfg) == (
        CHUNK + 3 * BLOCK
    )
    # read without the key: sealed entries (chunks and aliases alike) are misses
    assert (
        load_in_fresh_engine(
            tmp_path, diverging(CHUNK + 3 * BLOCK), src, tiers=["local_cpu", "local_disk"]
        )
        == 0
    )


def alias_file(path, e: CacheEngine, at: int):
    """The disk file of the alias ``diverging(at)`` looks up first (its longest)."""
    tail = e.tail_spans(diverging(at), at // CHUNK)
    key = e.keys.alias_key(bytes.fromhex(tail[(at % CHUNK) // BLOCK - 1].key.chunk_hash))
    disk = e.storage.lower[0]  # type: ignore[attr-defined]
    return key, disk.path_of(key)


def test_a_corrupt_or_foreign_alias_file_is_a_miss(tmp_path) -> None:
    cfg = {"tiers": ["local_cpu", "local_disk"]}
    src = store_doc(tmp_path, **cfg)
    at = CHUNK + 3 * BLOCK
    e = engine(tmp_path, **cfg)
    _, path = alias_file(tmp_path, e, at)
    chunk_key = e.full_spans(DOC)[1].key
    chunk_path = e.storage.lower[0].path_of(chunk_key)  # type: ignore[attr-defined]
    e.close()
    good = path.read_bytes()
    blob = bytearray(good)
    blob[-8] ^= 0xFF  # a flipped payload byte: the checksum fails
    path.write_bytes(bytes(blob))
    # the longest alias is rejected; the next one (two blocks) is used
    assert load_in_fresh_engine(tmp_path, diverging(at), src, **cfg) == CHUNK + 2 * BLOCK
    assert not path.exists()  # rejected entries are deleted
    # a KV chunk's file planted under the alias's name: foreign (its header names the chunk)
    path.write_bytes(chunk_path.read_bytes())
    assert load_in_fresh_engine(tmp_path, diverging(at), src, **cfg) == CHUNK + 2 * BLOCK
    # an alias file planted under a chunk's name is not KV either
    chunk_bytes = chunk_path.read_bytes()
    chunk_path.write_bytes(good)
    assert load_in_fresh_engine(tmp_path, diverging(at), src, **cfg) == CHUNK
    chunk_path.write_bytes(chunk_bytes)


def test_the_codec_keeps_kinds_apart() -> None:
    alias_key = ChunkKey("m", LAYOUT.fingerprint(), 1, 0, "-", "alias-" + "ab" * 16)
    chunk_key = ChunkKey("m", LAYOUT.fingerprint(), 1, 0, "-", "ab" * 16)
    meta = alias_meta(2 * BLOCK)
    payload = memoryview(bytes(meta.nbytes))
    header, trailer = codec.encode(alias_key, meta, LAYOUT, payload)
    blob = header + bytes(payload) + trailer
    got, _ = codec.decode(blob, key=alias_key, layout=LAYOUT, max_tokens=CHUNK)
    assert got.meta == meta
    with pytest.raises(codec.PayloadError, match="foreign"):
        codec.decode(blob, key=chunk_key, layout=LAYOUT, max_tokens=CHUNK)
    kv = MemoryObjMeta(LAYOUT.chunk_shape(BLOCK), LAYOUT.chunk_dtype, BLOCK)
    with pytest.raises(ValueError, match="alias"):
        codec.encode(alias_key, kv, LAYOUT, memoryview(bytes(kv.nbytes)))
    # a well-formed KV header naming the alias key is refused (its kind is not alias)
    fields = {
        "key": alias_key.to_string(),
        "layout": LAYOUT.fingerprint(),
        "dtype": LAYOUT.dtype,
        "shape": list(kv.shape),
        "tokens": BLOCK,
    }
    body = json.dumps(fields).encode()
    head = codec.PREFIX.pack(codec.MAGIC, codec.FORMAT_VERSION, 0, len(body), kv.nbytes) + body
    with pytest.raises(codec.PayloadError, match="foreign: an alias key"):
        codec.decode_header(head, key=alias_key, layout=LAYOUT, max_tokens=CHUNK)


def test_a_dangling_alias_on_disk_is_a_miss(tmp_path) -> None:
    cfg = {"tiers": ["local_cpu", "local_disk"]}
    src = store_doc(tmp_path, **cfg)
    e = engine(tmp_path, **cfg)
    chunk_path = e.storage.lower[0].path_of(e.full_spans(DOC)[1].key)  # type: ignore[attr-defined]
    e.close()
    chunk_path.unlink()
    assert load_in_fresh_engine(tmp_path, diverging(CHUNK + 3 * BLOCK), src, **cfg) == CHUNK


def test_aliases_ride_in_their_chunks_queue_slot(tmp_path) -> None:
    e = engine(tmp_path, tiers=["local_cpu", "local_disk"], write_queue_size=4)
    try:
        e.register_kv_caches(caches(0, NUM_BLOCKS))
        assert e.store(DOC, torch.arange(len(DOC))) == len(DOC)
        assert e.storage.flush(30), e.storage.last_flush
        stats = e.storage.stats  # type: ignore[attr-defined]
        assert stats.get("write_queue.dropped") == 0
        assert stats.get("put.aliases") == 3 * (CHUNK // BLOCK - 1)
        assert stats.get("local_disk.stored") == 3  # chunks (tier_stored_chunks)
        assert stats.get("local_disk.alias_stored") == 3 * (CHUNK // BLOCK - 1)
    finally:
        e.close()


@pytest.mark.redis
@pytest.mark.parametrize("at", [CHUNK - BLOCK, CHUNK + BLOCK, 2 * CHUNK + 3 * BLOCK])
def test_redis_serves_another_engines_aliases(tmp_path, redis_clean, at: int) -> None:
    cfg = {"tiers": ["local_cpu", "redis"], "redis_url": redis_clean.url}
    src = store_doc(tmp_path / "a", **cfg)
    assert load_in_fresh_engine(tmp_path / "b", diverging(at), src, **cfg) == at

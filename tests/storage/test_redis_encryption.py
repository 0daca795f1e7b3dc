"""Encryption at rest in the Redis tier (``encryption_key``), against a real redis-server and a
real 3-node cluster on loopback: what is stored is AES-256-GCM ciphertext; a wrong key, a
tampered or truncated value, a plain value read with a key and a sealed one read without are
misses, counted and deleted, never wrong KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from storage_helpers import (
    ARENA_BYTES,
    CHUNK,
    LAYOUT,
    NAMESPACE,
    check_obj,
    chunk_value,
    config,
    key,
    meta,
    put_chunk,
)
from test_redis import redis_key, redis_manager, stored

from fixtures.redis_client import RedisClient
from kvtier.core.memory import HostArena
from kvtier.storage import codec
from kvtier.storage.backends.base import BackendContext
from kvtier.storage.backends.redis.backend import RedisBackend
from kvtier.storage.backends.redis.format import TAIL
from kvtier.storage.sealing import Sealer
from kvtier.storage.stats import StorageStats

pytest.importorskip("cryptography", reason="kvtier[encryption] is not installed")

pytestmark = pytest.mark.redis

KEY_A = "11" * 32
KEY_B = "22" * 32
# a 16-token test chunk is 2048 bytes: sealed, 2064, stored as segments :0 :1 and :2 (the tag)
SEALED_KEYS = 3


def entries(i: int, n: int = SEALED_KEYS) -> list[str]:
    return [redis_key(i)] + [f"{redis_key(i)}:{s}" for s in range(n)]


def sealed_manager(make_manager, url, enc_key=KEY_A, **kw):
    return redis_manager(
        make_manager, url, **({"encryption_key": enc_key} if enc_key else {}), **kw
    )


def get_and_release(m, i):
    obj = m.get(key(i))
    if obj is None:
        return None
    try:
        return obj.tensor.clone()
    finally:
        obj.release()


def test_round_trip_stores_only_ciphertext(make_manager, redis_clean):
    m = sealed_manager(make_manager, redis_clean.url)
    stored(m, 0, 1, 2)
    client = RedisClient(redis_clean.url)
    assert sorted(k.decode() for k in client.keys("*")) == sorted(
        k for i in range(3) for k in entries(i)
    )
    plain = chunk_value(0).view(-1).view(torch.uint8).numpy().tobytes()
    stored_bytes = b"".join(client.get(k) for k in entries(0))
    assert plain[:64] not in stored_bytes and plain[1000:1064] not in stored_bytes
    assert m.prefix_hits([key(i) for i in range(4)]) == 3
    objs = m.batched_get([key(i) for i in range(3)])
    for i, obj in enumerate(objs):
        check_obj(obj, i)
        obj.release()
    m.close()
    again = sealed_manager(make_manager, redis_clean.url)  # another engine with the same key
    assert torch.equal(get_and_release(again, 1), chunk_value(1))
    assert again.stats.get("redis.corrupt") == 0


def test_partial_chunk_round_trip(make_manager, redis_clean):
    """A 5-token chunk (640 bytes + tag) fits one segment: ciphertext and tag share it."""
    m = sealed_manager(make_manager, redis_clean.url)
    put_chunk(m, 0, tokens=5)
    assert m.flush(10)
    m.host.remove([key(0)])
    obj = m.get(key(0))
    assert obj is not None and obj.num_tokens == 5
    assert torch.equal(obj.tensor, chunk_value(0, 5))
    obj.release()


@pytest.mark.parametrize("reader", ["other_key", "no_key"])
def test_another_key_or_none_is_a_counted_miss_and_is_deleted(make_manager, redis_clean, reader):
    m = sealed_manager(make_manager, redis_clean.url)
    stored(m, 0, 1)
    m.close()
    m2 = sealed_manager(make_manager, redis_clean.url, KEY_B if reader == "other_key" else None)
    client = RedisClient(redis_clean.url)
    if reader == "other_key":
        assert m2.prefix_hits([key(0)]) == 0  # the head's key check: a lookup already knows
    assert m2.get(key(0)) is None
    assert m2.get(key(1)) is None
    assert m2.stats.get("redis.corrupt") == 2
    assert m2.stats.get("redis.sealed_rejected") == 2
    assert client.exists(*entries(0), *entries(1)) == 0  # every segment, the tag's included


def test_a_plain_value_read_with_a_key_is_a_counted_miss(make_manager, redis_clean):
    m = sealed_manager(make_manager, redis_clean.url, None)
    stored(m, 0, 1)
    m.close()
    m2 = sealed_manager(make_manager, redis_clean.url)
    assert m2.contains([key(0)]) == [False]
    assert m2.get(key(1)) is None
    assert m2.stats.get("redis.sealed_rejected") == 2
    assert RedisClient(redis_clean.url).exists(*entries(0, 2), *entries(1, 2)) == 0
    stored(m2, 0)  # and the key is usable again
    assert torch.equal(get_and_release(m2, 0), chunk_value(0))


def _rewrite_head_checksum(client, i: int) -> None:
    """Recompute chunk ``i``'s trailer over what its segments now hold (a forger who knows the
    format but not the key)."""
    head = client.get(redis_key(i))
    header_len, _ = codec.prefix_lengths(head)
    payload = b"".join(client.get(k) for k in entries(i)[1:])
    trailer = codec.trailer(head[:header_len], payload)
    client.set(redis_key(i), head[:header_len] + trailer + head[-TAIL.size :])


DAMAGE = [
    "ciphertext-byte",
    "tag-byte",
    "forged-ciphertext",
    "forged-tag",
    "truncated-tag",
    "missing-tag",
    "nonce-edited",
    "swapped-chunks",
]


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_tampered_value_is_a_miss(make_manager, redis_clean, damage):
    m = sealed_manager(make_manager, redis_clean.url)
    stored(m, 0, 1)
    client = RedisClient(redis_clean.url)
    seg, tag = entries(0)[2], entries(0)[3]

    def flip(name: str, at: int) -> None:
        b = bytearray(client.get(name))
        b[at] ^= 0x01
        client.set(name, bytes(b))

    if damage == "ciphertext-byte":  # the checksum sees it
        flip(seg, 100)
    elif damage == "tag-byte":
        flip(tag, 3)
    elif damage == "forged-ciphertext":  # the checksum is made to match: only the tag can tell
        flip(seg, 100)
        _rewrite_head_checksum(client, 0)
    elif damage == "forged-tag":
        flip(tag, 15)
        _rewrite_head_checksum(client, 0)
    elif damage == "truncated-tag":
        client.set(tag, client.get(tag)[:-1])
    elif damage == "missing-tag":
        client.delete(tag)
    elif damage == "nonce-edited":  # a header byte (the nonce's hex) with a matching checksum
        head = bytearray(client.get(redis_key(0)))
        at = head.index(b'"nonce":"') + len(b'"nonce":"')
        head[at] = ord("0") if head[at] != ord("0") else ord("1")
        header_len, _ = codec.prefix_lengths(bytes(head))
        payload = b"".join(client.get(k) for k in entries(0)[1:])
        client.set(
            redis_key(0),
            bytes(head[:header_len])
            + codec.trailer(bytes(head[:header_len]), payload)
            + bytes(head[-TAIL.size :]),
        )
    else:  # chunk 1's whole entry under chunk 0's keys: the header names chunk 1
        for src, dst in zip(entries(1), entries(0), strict=True):
            client.set(dst, client.get(src))
    assert m.get(key(0)) is None
    assert m.stats.get("redis.corrupt") == 1
    # only what passes the checksum reaches the key check or the tag
    forged = damage in ("forged-ciphertext", "forged-tag", "nonce-edited")
    assert m.stats.get("redis.sealed_rejected") == (1 if forged else 0)
    assert client.exists(*entries(0)) == 0
    assert torch.equal(get_and_release(m, 1), chunk_value(1))  # the neighbour still hits


def test_cluster_round_trip_and_wrong_key(make_manager, redis_cluster):
    redis_cluster.flush()
    m = sealed_manager(make_manager, redis_cluster.url, redis_cluster=True)
    stored(m, *range(8))
    assert m.prefix_hits([key(i) for i in range(8)]) == 8
    objs = m.batched_get([key(i) for i in range(8)])
    for i, obj in enumerate(objs):
        check_obj(obj, i)
        obj.release()
    m.close()
    other = sealed_manager(make_manager, redis_cluster.url, KEY_B, redis_cluster=True)
    assert other.prefix_hits([key(0)]) == 0
    assert other.batched_get([key(i) for i in range(8)]) == [None] * 8
    assert other.stats.get("redis.sealed_rejected") == 8


# -- property: any single bit flip anywhere in a stored chunk is a miss, never wrong KV --------
def _backend(url: str, segment_bytes: int, arena: HostArena, tmp_path: Path) -> RedisBackend:
    cfg = config(
        tmp_path,
        tiers=["local_cpu", "redis"],
        redis_url=url,
        encryption_key=KEY_A,
        # An untouched chunk must read back: a loaded machine's slow call is not a miss here.
        redis_timeout_s=10.0,
        backend_options={"redis": {"segment_bytes": segment_bytes, "retry_interval_s": 0.2}},
    )
    return RedisBackend(
        BackendContext(
            config=cfg,
            layout=LAYOUT,
            namespace=NAMESPACE,
            arena=arena,
            stats=StorageStats(),
            options=cfg.backend_options["redis"],
            sealer=Sealer(bytes.fromhex(KEY_A)),
        )
    )


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tokens=st.integers(1, CHUNK),
    segment_bytes=st.integers(1024, 3000),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
    damage=st.booleans(),
)
@example(tokens=16, segment_bytes=1030, where=0.999, bit=0, damage=False)  # the tag across two
@example(tokens=16, segment_bytes=1030, where=0.999, bit=0, damage=True)  # segments, the last one
@example(tokens=16, segment_bytes=1024, where=0.999, bit=7, damage=True)  # the tag alone
@example(tokens=2, segment_bytes=1024, where=0.4609375, bit=0, damage=True)  # the segment size
def test_sealed_chunks_read_back_exactly_or_miss(
    redis_clean, tmp_path, tokens, segment_bytes, where, bit, damage
):
    """For any segment size (the tag within one segment or across two) and chunk length: an
    untouched chunk reads back bit for bit; one bit flipped in any stored value (head or any
    segment) is a miss and the entry is gone."""
    redis_clean.flush()
    arena = HostArena.create(ARENA_BYTES)
    b = _backend(redis_clean.url, segment_bytes, arena, tmp_path)
    try:
        src = arena.allocate(meta(tokens))
        src.tensor.copy_(chunk_value(3, tokens))
        b.batched_put([(key(3), src)])
        src.release()
        client = RedisClient(redis_clean.url)
        names = sorted(k.decode() for k in client.keys("*"))
        assert len(names) == 1 + -(-(meta(tokens).nbytes + 16) // segment_bytes)
        if damage:
            sizes = [client.strlen(n) for n in names]
            at = int(where * sum(sizes))
            for name, size in zip(names, sizes, strict=True):
                if at < size:
                    v = bytearray(client.get(name))
                    v[at] ^= 1 << bit
                    client.set(name, bytes(v))
                    break
                at -= size
        (obj,) = b.batched_get([key(3)], arena.allocate)
        if damage:
            assert obj is None
            assert client.exists(*names) == 0
        else:
            assert obj is not None and torch.equal(obj.tensor, chunk_value(3, tokens))
            obj.release()
    finally:
        b.close()
    assert arena.used_bytes == 0

"""Block-granular hits inside stored full chunks (aliases, ``kvtier.core.keys.aliases``): a prompt
hits every whole block it shares with a stored prompt, wherever inside a chunk they diverge, and
loads exactly the stored prompt's KV for those blocks; an alias that is dangling, corrupt or
not the one asked for is a miss, never wrong KV."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import (
    BLOCK,
    CHUNK,
    NUM_BLOCKS,
    make_engine,
    make_layout,
    random_caches,
    random_slots,
    token_view,
)

from kvtier.core import CacheEngine, PagedLayout
from kvtier.core.keys import token_bytes
from kvtier.core.keys.aliases import ALIAS_NBYTES, Alias, decode_alias, encode_alias

LAYOUT = make_layout(PagedLayout.LBHNC)
SLOTS = NUM_BLOCKS * BLOCK


def engine_with_caches(**cfg: object) -> tuple[CacheEngine, list[torch.Tensor]]:
    engine = make_engine(LAYOUT, **cfg)
    caches = random_caches(LAYOUT)
    engine.register_kv_caches(caches)
    return engine, caches


def slots_for(n: int, seed: int) -> torch.Tensor:
    """Slots in whole, randomly chosen cache blocks (as vLLM's block table)."""
    return random_slots(n, seed)


def shared_pair(data: st.DataObject) -> tuple[list[int], list[int], int]:
    """A stored prompt and a second one that diverges from it at a random token."""
    stored_len = data.draw(st.integers(CHUNK + BLOCK, 4 * CHUNK), label="stored_len")
    diverge = data.draw(st.integers(0, stored_len), label="diverge")
    extra = data.draw(st.integers(0, 2 * CHUNK), label="extra")
    stored = list(range(10_000, 10_000 + stored_len))
    other = stored[:diverge] + list(range(50_000, 50_000 + extra))
    return stored, other, diverge


def whole_blocks(n: int) -> int:
    return n - n % BLOCK


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), tails=st.booleans(), use_hold=st.booleans())
def test_a_prompt_hits_every_whole_block_it_shares(
    data: st.DataObject, tails: bool, use_hold: bool
) -> None:
    stored, other, diverge = shared_pair(data)
    engine, caches = engine_with_caches(save_unfull_chunk=tails)
    try:
        ref = [c.clone() for c in caches]
        stored_slots = slots_for(len(stored), seed=1)
        engine.store(stored, stored_slots)
        # what the stored prompt left: its full chunks, and its tail blocks when tails are kept
        kept = whole_blocks(len(stored)) if tails else len(stored) - len(stored) % CHUNK
        shared = min(whole_blocks(min(diverge, len(other))), kept)
        assert engine.lookup(other) == shared

        for c in caches:
            c.zero_()
        other_slots = slots_for(len(other), seed=2)
        if use_hold:
            with engine.hold(other) as hold:
                assert hold.num_tokens == shared
                mask = engine.retrieve(other, other_slots, hold=hold)
        else:
            mask = engine.retrieve(other, other_slots)
        assert int(mask.sum()) == shared and bool(mask[:shared].all())
        for got, want in zip(caches, ref, strict=True):
            g, w = token_view(LAYOUT, got), token_view(LAYOUT, want)
            # the loaded slots hold the stored prompt's KV of the same positions, bit for bit
            assert torch.equal(
                g[other_slots[:shared]].view(torch.uint8),
                w[stored_slots[:shared]].view(torch.uint8),
            )
            # and nothing else was written (the rest of an aliased chunk is skipped)
            untouched = torch.ones(SLOTS, dtype=torch.bool)
            untouched[other_slots[:shared]] = False
            assert not g[untouched].any()
    finally:
        engine.close()
    assert engine.storage.arena.used_bytes == 0  # type: ignore[attr-defined]


def test_one_block_before_and_after_a_chunk_boundary() -> None:
    engine, _ = engine_with_caches()
    stored = list(range(3 * CHUNK))
    engine.store(stored, slots_for(len(stored), seed=1))
    for diverge in (CHUNK - BLOCK, CHUNK + BLOCK, 2 * CHUNK - BLOCK, 2 * CHUNK + BLOCK):
        other = stored[:diverge] + [7] * CHUNK
        assert engine.lookup(other) == diverge
    engine.close()


def test_the_longest_alias_wins_over_a_shorter_tail_run() -> None:
    engine, _ = engine_with_caches()
    doc = list(range(1000, 1000 + CHUNK))
    # a short prompt stores one tail block after the document; a long one stores the next chunk
    engine.store(doc + [5] * (BLOCK + 3), slots_for(CHUNK + BLOCK + 3, seed=1))
    engine.store(doc + [5] * CHUNK, slots_for(2 * CHUNK, seed=2))
    other = doc + [5] * (3 * BLOCK) + [6] * CHUNK
    assert engine.lookup(other) == CHUNK + 3 * BLOCK
    engine.close()


def test_a_dangling_alias_is_a_miss() -> None:
    engine, _ = engine_with_caches(save_unfull_chunk=False)
    stored = list(range(2 * CHUNK))
    engine.store(stored, slots_for(len(stored), seed=1))
    other = stored[: CHUNK + 2 * BLOCK] + [9] * CHUNK
    assert engine.lookup(other) == CHUNK + 2 * BLOCK
    second = engine.full_spans(stored)[1]
    engine.storage._index.remove([second.key])  # type: ignore[attr-defined]
    assert engine.lookup(other) == CHUNK
    with engine.hold(other) as hold:
        assert hold.num_tokens == CHUNK
    engine.close()


def test_an_alias_naming_something_else_is_a_miss() -> None:
    engine, _ = engine_with_caches(save_unfull_chunk=False)
    stored = list(range(2 * CHUNK))
    engine.store(stored, slots_for(len(stored), seed=1))
    other = stored[: CHUNK + 2 * BLOCK] + [9] * CHUNK
    tail = engine.tail_spans(other, 1)
    alias_key = engine.keys.alias_key(bytes.fromhex(tail[1].key.chunk_hash))
    good = engine.storage.get(alias_key)
    assert good is not None
    target = decode_alias(good, bytes.fromhex(tail[1].key.chunk_hash), 2 * BLOCK)
    good.release()
    assert target == bytes.fromhex(engine.full_spans(stored)[1].key.chunk_hash)
    index = engine.storage._index  # type: ignore[attr-defined]
    bad_records = [
        Alias(bytes.fromhex(tail[0].key.chunk_hash), target, 2 * BLOCK),  # another alias's record
        Alias(bytes.fromhex(tail[1].key.chunk_hash), target, BLOCK),  # wrong length
        Alias(bytes.fromhex(tail[1].key.chunk_hash), b"\x01" * 16, 2 * BLOCK),  # no such chunk
    ]
    for record in bad_records:
        obj = encode_alias(record, engine.storage.allocate)
        assert obj is not None
        index.remove([alias_key])
        index.put([(alias_key, obj)])
        obj.release()
        # only the shorter alias (one block) is left to use
        assert engine.lookup(other) == CHUNK + BLOCK
    # a KV chunk planted under the alias key is not an alias either
    kv = engine.storage.get(engine.full_spans(stored)[1].key)
    assert kv is not None
    index.remove([alias_key])
    index.put([(alias_key, kv)])
    kv.release()
    assert engine.lookup(other) == CHUNK + BLOCK
    engine.close()


def test_an_alias_record_round_trips_and_checks_what_it_names() -> None:
    engine, _ = engine_with_caches()
    alias = Alias(b"\x02" * 16, b"\x03" * 16, 3 * BLOCK)
    obj = encode_alias(alias, engine.storage.allocate)
    assert obj is not None and obj.meta.nbytes == ALIAS_NBYTES
    assert decode_alias(obj, alias.tail_hash, 3 * BLOCK) == alias.target_hash
    assert decode_alias(obj, b"\x04" * 16, 3 * BLOCK) is None
    assert decode_alias(obj, alias.tail_hash, 2 * BLOCK) is None
    obj.byte_view()[0] ^= 0xFF  # corrupt the magic
    assert decode_alias(obj, alias.tail_hash, 3 * BLOCK) is None
    obj.release()
    engine.close()


def test_full_spans_are_the_prefix_hashes() -> None:
    from kvtier.core.keys import prefix_hashes

    engine, _ = engine_with_caches()
    tokens = list(range(3 * CHUNK + 5))
    spans = engine.full_spans(tokens, scope="s")
    assert [bytes.fromhex(s.key.chunk_hash) for s in spans] == prefix_hashes(
        token_bytes(tokens), CHUNK, "s"
    )
    engine.close()


def test_a_held_chunk_keeps_its_aliases_through_eviction() -> None:
    """Eviction skips held chunks; their aliases (tiny entries of their own) must survive with
    them, or a prompt diverging inside a held chunk would lose the blocks it shares."""
    per_chunk = LAYOUT.chunk_nbytes(CHUNK)
    engine = make_engine(LAYOUT, arena_bytes=4 * per_chunk)
    engine.register_kv_caches(random_caches(LAYOUT))
    doc = list(range(2 * CHUNK))
    engine.store(doc, slots_for(len(doc), seed=1))
    diverging = doc[: CHUNK + 2 * BLOCK] + [9] * CHUNK
    with engine.hold(doc) as hold:
        assert hold.num_tokens == 2 * CHUNK
        for i in range(6):  # more than the arena: everything not held is evicted
            other = list(range(1000 * (i + 1), 1000 * (i + 1) + CHUNK))
            engine.store(other, slots_for(CHUNK, seed=i + 5))
        assert engine.lookup(diverging) == CHUNK + 2 * BLOCK
    engine.close()
    assert engine.storage.arena.used_bytes == 0  # type: ignore[attr-defined]

"""``PromptHashes``: a prompt's hash chain computed once, lazily, and byte for byte the hashes of
the plain functions in ``kvtier.core.keys`` (stored keys must not change)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import BLOCK, CHUNK, make_engine, make_layout, random_caches, random_slots

from kvtier.core import PagedLayout
from kvtier.core import keys as keys_module
from kvtier.core.keys import KeyScope, prefix_hashes, salt_seed, tail_hashes, token_bytes
from kvtier.core.keys import prompt as prompt_module
from kvtier.core.keys.prompt import PromptHashes

scopes = st.one_of(
    st.none(),
    st.sampled_from(["", "tenant-a", "tenant-b"]),
    st.builds(
        KeyScope,
        st.sampled_from([None, "tenant-a"]),
        st.sampled_from([None, "lora-1"]),
        st.sampled_from([None, "gen-2"]),
    ),
)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 200_000), max_size=400),
    block=st.integers(1, 16),
    blocks_per_chunk=st.integers(1, 8),
    scope=scopes,
    order=st.lists(st.integers(-3, 60), max_size=12),
)
def test_the_hashes_are_the_plain_functions(
    tokens: list[int], block: int, blocks_per_chunk: int, scope: object, order: list[int]
) -> None:
    """Asked in any order, every full-chunk hash, tail hash and prefix digest is the one the
    plain functions give for the whole prompt."""
    chunk = block * blocks_per_chunk
    prompt = PromptHashes(tokens, scope, chunk, block)  # type: ignore[arg-type]
    want = prefix_hashes(tokens, chunk, scope)  # type: ignore[arg-type]
    arr = token_bytes(tokens)
    seed = salt_seed(scope)  # type: ignore[arg-type]

    def plain_tail(i: int) -> list[bytes]:
        return tail_hashes(arr, i * chunk, chunk, block, want[i - 1] if i else seed)

    for i in order:  # out of order first: the lazy chain must not depend on the order asked
        if 0 <= i < len(want):
            assert prompt.full[i] == want[i]
        if 0 <= i <= len(want):
            assert prompt.tail_hashes(i) == plain_tail(i)
    assert list(prompt.full) == want and len(prompt.full) == len(want)
    assert prompt.full[1:3] == want[1:3] and prompt.full[::-1] == want[::-1]
    assert (prompt.arr == arr).all() and prompt.arr.dtype == arr.dtype
    for i in range(len(want) + 1):
        tail = plain_tail(i)
        assert prompt.tail_hashes(i) == tail
        assert prompt.digest(i * chunk) == (want[i - 1] if i else seed)
        for j, h in enumerate(tail, 1):
            assert prompt.digest(i * chunk + j * block) == h


def test_a_digest_ends_where_a_hit_can() -> None:
    prompt = PromptHashes(list(range(3 * CHUNK // 2)), None, CHUNK, BLOCK)
    with pytest.raises(ValueError, match="no hit ends"):
        prompt.digest(CHUNK + 1)  # not a whole block
    with pytest.raises(ValueError, match="no hit ends"):
        prompt.digest(CHUNK + CHUNK // 2 + BLOCK)  # past the prompt


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[tuple[bytes, bytes]]]:
    """Every (previous hash, token bytes) the chain hashes, counted."""
    calls: Counter[tuple[bytes, bytes]] = Counter()
    plain = keys_module.chain_hash

    def counted(prev: bytes, token_arr: np.ndarray) -> bytes:
        calls[prev, token_arr.tobytes()] += 1
        return plain(prev, token_arr)

    monkeypatch.setattr(keys_module, "chain_hash", counted)
    monkeypatch.setattr(prompt_module, "chain_hash", counted)
    yield calls


@pytest.mark.parametrize("tails", [False, True])
def test_one_engine_call_hashes_each_span_once(
    hashed: Counter[tuple[bytes, bytes]], tails: bool
) -> None:
    """A store, a hold, and a retrieve from the hold each hash every chunk and block once,
    however many times the span planner, store writer and hold check use its hash."""
    layout = make_layout(PagedLayout.LBHNC)
    engine = make_engine(layout, save_unfull_chunk=tails)
    engine.register_kv_caches(random_caches(layout))
    stored = list(range(100, 100 + 3 * CHUNK + 2 * BLOCK + 3))
    other = stored[: CHUNK + 2 * BLOCK + 1] + [7] * CHUNK  # diverges inside the second chunk
    slots = random_slots(len(other))
    try:
        engine.store(stored, random_slots(len(stored)), scope="s")
        assert hashed and max(hashed.values()) == 1
        hashed.clear()
        with engine.hold(other, "s") as hold:
            assert hold.num_tokens == CHUNK + 2 * BLOCK
            assert max(hashed.values()) == 1
            hashed.clear()
            assert engine.retrieve(other, slots, scope="s", hold=hold).sum() == hold.num_tokens
            assert max(hashed.values()) == 1
            changed = [*other[:CHUNK], 1, *other[CHUNK + 1 :]]  # a token of the alias span
            with pytest.raises(ValueError, match="other tokens"):
                engine.retrieve(changed, slots, scope="s", hold=hold)
            changed = other[: hold.num_tokens] + [1] * (len(other) - hold.num_tokens)
            assert engine.retrieve(changed, slots, scope="s", hold=hold).sum() == hold.num_tokens
    finally:
        engine.close()

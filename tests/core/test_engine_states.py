"""A Mamba hybrid's engine (``KVLayout.states``) through ``CacheEngine`` on the CPU platform:
chunks hold the attention pages, state entries one block of each state group
(``kvtier.core.engine.states``). A hit ends at the longest full-chunk prefix, before the prompt's last
token, whose chunks and state are both stored; a load fills the state's blocks with exactly
the bytes stored from the offered blocks, or loads nothing at all."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.kv_views import replica_views
from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
from kvtier.core.keys import KeyFactory
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.storage.codec import PayloadError, decode, encode

BLOCK = 16
CHUNK = 32
NUM_BLOCKS = 48
STATES = ("MambaSpec/gdn/3x64:bfloat16",)
LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_size=8, dtype="bfloat16", block_size=BLOCK, states=STATES
)


def engine(seed: int = 0) -> tuple[CacheEngine, list[torch.Tensor]]:
    config = load_config(env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"]})
    storage = HostMemoryStorageManager(HostArena.create(16 << 20))
    eng = CacheEngine(config, LAYOUT, model="test/mamba", platform=CPUPlatform(), storage=storage)
    g = torch.Generator().manual_seed(seed)
    views = replica_views(LAYOUT, NUM_BLOCKS)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=g).to(LAYOUT.torch_dtype))
    eng.register_kv_caches(views)
    return eng, views


def slots(blocks: list[int], n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.tensor(blocks, dtype=torch.long)[pos // BLOCK] * BLOCK + pos % BLOCK


def page(views: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    return [v[block].clone() for v in views]


PROMPT = list(range(100, 100 + 5 * CHUNK + 7))  # 5 full chunks and a tail


@settings(max_examples=30, deadline=None)
@given(
    chunks=st.integers(0, 5),
    states=st.sets(st.integers(1, 5)),
    length=st.integers(1, 5 * CHUNK + 7),
)
def test_a_hit_ends_at_the_longest_stored_chunks_with_a_state(chunks, states, length) -> None:
    eng, _ = engine()
    n = chunks * CHUNK
    if n:
        eng.store(PROMPT[:n], slots(list(range(1, 1 + n // BLOCK)), n))
    for k in states:
        eng.store_state(PROMPT, k * CHUNK, [40 + k])
    tokens = PROMPT[:length]
    want = max((k * CHUNK for k in states if k <= chunks and k * CHUNK <= length - 1), default=0)
    assert eng.lookup(tokens) == want
    with eng.hold(tokens) as hold:
        assert hold.num_tokens == want
        assert (hold.state is not None) == bool(want)
        if hold.state is not None:
            assert hold.state[0] == want


def test_a_load_fills_the_attention_pages_and_the_state_exactly() -> None:
    eng, views = engine()
    n = 3 * CHUNK
    src = list(range(1, 1 + n // BLOCK))
    eng.store(PROMPT[:n], slots(src, n))
    assert eng.store_state(PROMPT, 2 * CHUNK, [44])  # the state after 64 tokens, in block 44
    assert not eng.store_state(PROMPT, 2 * CHUNK, [45])  # stored once
    want_pages = [page(views, b) for b in src[: 2 * CHUNK // BLOCK]]
    want_state = page(views, 44)
    tokens = PROMPT[: 2 * CHUNK + 5]
    with eng.hold(tokens) as hold:
        assert hold.num_tokens == 2 * CHUNK
        for v in views:
            v.zero_()
        dst = list(range(20, 20 + 2 * CHUNK // BLOCK))
        target = torch.full((len(tokens),), -1)
        target[: 2 * CHUNK] = slots(dst, 2 * CHUNK)
        mask = eng.retrieve(tokens, target, hold=hold, state_blocks=[30])
    assert bool(mask[: 2 * CHUNK].all()) and not bool(mask[2 * CHUNK :].any())
    for b, pages in zip(dst, want_pages, strict=True):
        assert all(torch.equal(v[b], p) for v, p in zip(views, pages, strict=True))
    assert all(torch.equal(v[30], p) for v, p in zip(views, want_state, strict=True))


def test_without_its_state_a_load_loads_nothing() -> None:
    """Attention pages without the state at their end are of no use to vLLM (it would run
    from a wrong state): the load writes nothing and its mask says so."""
    eng, views = engine()
    n = 2 * CHUNK
    eng.store(PROMPT[:n], slots(list(range(1, 1 + n // BLOCK)), n))
    before = [v.clone() for v in views]
    mask = eng.retrieve(PROMPT[: n + 3], torch.cat([slots(list(range(20, 24)), n),
                                                    torch.full((3,), -1)]), state_blocks=[30])  # fmt: skip
    assert not bool(mask.any()) and eng.stats.state_misses == 1
    assert all(torch.equal(a, b) for a, b in zip(views, before, strict=True))
    # vLLM gave no block for the state: nothing loads either.
    eng.store_state(PROMPT, n, [44])
    target = torch.cat([slots(list(range(20, 24)), n), torch.full((3,), -1)])
    assert not bool(eng.retrieve(PROMPT[: n + 3], target).any())
    assert all(torch.equal(a, b) for a, b in zip(views, before, strict=True))
    with eng.hold(PROMPT[: n + 3]) as hold:
        assert hold.num_tokens == n
        assert not bool(eng.retrieve(PROMPT[: n + 3], target, hold=hold).any())


def test_a_state_key_never_decodes_as_kv_nor_a_chunk_key_as_a_state() -> None:
    """The codec tells the kinds apart by the key: a state payload read under a chunk key (or
    the reverse) is refused, as is a state of another state geometry."""
    from kvtier.core.memory import MemoryObjMeta

    keys = KeyFactory("test/mamba", LAYOUT.fingerprint())
    state_key, chunk_key = keys.state_key(b"\x01" * 16), keys.key(b"\x01" * 16)
    meta = MemoryObjMeta(LAYOUT.state_shape, LAYOUT.chunk_dtype, BLOCK)
    payload = (torch.arange(meta.nbytes) % 251).to(torch.uint8).numpy().tobytes()

    def blob(key, lay=LAYOUT, m=meta) -> bytes:
        header, trailer = encode(key, m, lay, memoryview(payload))
        return header + payload + trailer

    header, body = decode(blob(state_key), key=state_key, layout=LAYOUT, max_tokens=CHUNK)
    assert header.meta == meta and bytes(body) == payload
    with pytest.raises(PayloadError):
        decode(blob(state_key), key=chunk_key, layout=LAYOUT, max_tokens=CHUNK)
    as_chunk = MemoryObjMeta(LAYOUT.chunk_shape(BLOCK), LAYOUT.chunk_dtype, BLOCK)
    with pytest.raises(PayloadError):  # KV bytes of the same size, under the chunk's kind
        decode(blob(chunk_key, m=as_chunk), key=state_key, layout=LAYOUT, max_tokens=CHUNK)
    other = KVLayout(**{**LAYOUT.__dict__, "states": ("MambaSpec/gdn/4x64:bfloat16",)})
    with pytest.raises(PayloadError):
        decode(blob(state_key), key=state_key, layout=other, max_tokens=CHUNK)


def test_a_lookup_asks_the_tiers_whether_a_state_is_there_without_reading_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``lookup`` (an estimate) reads no state entry, a lower tier's included; ``hold`` reads the
    one its hit ends at."""
    eng, _ = engine()
    n = 3 * CHUNK
    eng.store(PROMPT[:n], slots(list(range(1, 1 + n // BLOCK)), n))
    eng.store_state(PROMPT, 2 * CHUNK, [41])
    reads: list = []
    get = eng.storage.get

    def counted(key, *args, **kwargs):  # type: ignore[no-untyped-def]
        reads.append(key)
        return get(key, *args, **kwargs)

    monkeypatch.setattr(eng.storage, "get", counted)
    assert eng.lookup(PROMPT) == 2 * CHUNK
    assert not any(k.is_state for k in reads)
    with eng.hold(PROMPT) as hold:
        assert hold.state is not None and hold.state[0] == 2 * CHUNK
    assert sum(k.is_state for k in reads) == 1

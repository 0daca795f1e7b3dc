"""CacheEngine end to end on the CPU platform: random paged KV -> store -> wipe -> retrieve gives
bit-identical KV, for every paged layout, MHA and MLA, three dtypes, partial chunks, -1 slots,
whole-chunk and layer-wise."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from fixtures.kv_views import replica_views
from kvtier.core import (
    CacheEngine,
    ConfigError,
    HostArena,
    HostMemoryStorageManager,
    KVLayout,
    KVTierError,
    LayoutError,
    PagedLayout,
    load_config,
)
from kvtier.core.keys import ChunkKey
from kvtier.core.memory import MemoryObj
from kvtier.core.platform.cpu import CPUPlatform

BLOCK = 16
CHUNK = 64
NUM_BLOCKS = 40
DTYPES = ["bfloat16", "float16", "float32"]


def make_layout(
    pl: PagedLayout, dtype: str = "bfloat16", layers: int = 3, mla: bool = False
) -> KVLayout:
    return KVLayout(
        num_layers=layers,
        num_kv_heads=1 if mla else 2,
        head_size=16 if mla else 8,
        dtype=dtype,
        block_size=BLOCK,
        paged_layout=pl,
        use_mla=mla,
    )


def make_engine(layout: KVLayout, arena_bytes: int = 8 << 20, **cfg: object) -> CacheEngine:
    config = load_config(env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"], **cfg})
    storage = HostMemoryStorageManager(HostArena.create(arena_bytes))
    return CacheEngine(config, layout, model="test/model", platform=CPUPlatform(), storage=storage)


def random_caches(layout: KVLayout, seed: int = 0) -> list[torch.Tensor]:
    """Views placed as vLLM places them, filled with random values."""
    g = torch.Generator().manual_seed(seed)
    views = replica_views(layout, NUM_BLOCKS)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=g).to(layout.torch_dtype))
    return views


def random_slots(n: int, seed: int = 1) -> torch.Tensor:
    """Slots of ``n`` tokens in whole, randomly chosen cache blocks (as vLLM's block table)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(NUM_BLOCKS, generator=g)[: -(-n // BLOCK)]
    return (blocks.unsqueeze(1) * BLOCK + torch.arange(BLOCK)).reshape(-1)[:n]


def token_view(layout: KVLayout, cache: torch.Tensor) -> torch.Tensor:
    """Per-slot KV of one layer as [slots, ...], through vLLM's logical [B, H, N, C] view."""
    return cache.permute(0, 2, 1, 3).reshape(NUM_BLOCKS * BLOCK, -1)


def assert_loaded_exactly(
    layout: KVLayout,
    caches: Sequence[torch.Tensor],
    ref: Sequence[torch.Tensor],
    loaded_slots: torch.Tensor,
) -> None:
    """Loaded slots hold the original bytes; every other slot is still zero."""
    loaded = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    loaded[loaded_slots] = True
    for got, want in zip(caches, ref, strict=True):
        g, w = token_view(layout, got), token_view(layout, want)
        assert torch.equal(g[loaded].view(torch.uint8), w[loaded].view(torch.uint8))
        assert not g[~loaded].any()


ALL_LAYOUTS = list(PagedLayout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("pl", ALL_LAYOUTS, ids=lambda p: p.value)
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_round_trip_is_bit_identical(
    pl: PagedLayout, mla: bool, dtype: str, layerwise: bool
) -> None:
    layout = make_layout(pl, dtype, mla=mla)
    engine = make_engine(layout)
    caches = random_caches(layout)
    ref = [c.clone() for c in caches]
    engine.register_kv_caches(caches)
    tokens = list(range(1000, 1150))  # 2 full chunks + 22 tokens (16 stored as a partial chunk)
    slots = random_slots(len(tokens))
    if layerwise:
        assert list(engine.store_layerwise(tokens, slots)) == list(range(layout.num_layers))
    else:
        assert engine.store(tokens, slots) == 144
    assert engine.lookup(tokens) == 144
    for c in caches:
        c.zero_()
    if layerwise:
        job = engine.retrieve_layerwise(tokens, slots)
        assert int(job.mask.sum()) == 144
        for layer in job.layers:
            # layer `layer` is loaded, the next one not yet
            if layer + 1 < layout.num_layers:
                assert not caches[layer + 1].any()
            assert caches[layer].any()
        mask = job.mask
    else:
        mask = engine.retrieve(tokens, slots)
    assert mask[:144].all() and not mask[144:].any()
    assert_loaded_exactly(layout, caches, ref, slots[:144])
    engine.close()
    assert engine.storage.arena.used_bytes == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("pl", ALL_LAYOUTS, ids=lambda p: p.value)
def test_prefix_the_engine_already_has_is_skipped(pl: PagedLayout) -> None:
    layout = make_layout(pl)
    engine = make_engine(layout)
    caches = random_caches(layout)
    ref = [c.clone() for c in caches]
    engine.register_kv_caches(caches)
    tokens = list(range(200))
    slots = random_slots(len(tokens))
    engine.store(tokens, slots)
    for c in caches:
        c.zero_()
    want = slots.clone()
    want[:80] = -1  # the engine holds the first 80 tokens (whole blocks, not a whole chunk)
    want[160:] = -1  # and only asked for up to 160
    mask = engine.retrieve(tokens, want)
    assert not mask[:80].any() and mask[80:160].all() and not mask[160:].any()
    assert_loaded_exactly(layout, caches, ref, slots[80:160])


def test_store_needs_every_slot_of_a_chunk() -> None:
    layout = make_layout(PagedLayout.LBHNC)
    engine = make_engine(layout)
    engine.register_kv_caches(random_caches(layout))
    tokens = list(range(192))
    slots = random_slots(len(tokens))
    slots[70] = -1  # chunk 1 cannot be saved; chunk 0 and 2 can, but 2 is useless without 1
    assert engine.store(tokens, slots) == 128
    assert engine.lookup(tokens) == 64
    assert engine.store(tokens, random_slots(len(tokens))) == 64  # only the missing chunk is new
    assert engine.lookup(tokens) == 192


def test_partial_chunks_extend_hits_at_block_granularity() -> None:
    layout = make_layout(PagedLayout.LBHNC)
    engine = make_engine(layout)
    engine.register_kv_caches(random_caches(layout))
    doc = list(range(5000, 5150))
    engine.store(doc, random_slots(len(doc)))
    assert engine.lookup(doc) == 144
    assert engine.lookup(doc[:140]) == 128  # the stored partial (16 tokens) needs 144 tokens
    longer = doc + list(range(100))
    assert engine.lookup(longer) == 144  # same document, then a different question
    other = doc[:130] + [1] * 20
    assert engine.lookup(other) == 128


def test_partial_chunks_can_be_turned_off() -> None:
    layout = make_layout(PagedLayout.LBHNC)
    engine = make_engine(layout, save_unfull_chunk=False)
    engine.register_kv_caches(random_caches(layout))
    doc = list(range(150))
    assert engine.store(doc, random_slots(150)) == 128
    assert engine.lookup(doc) == 128


def test_salts_do_not_share() -> None:
    layout = make_layout(PagedLayout.LBHNC)
    engine = make_engine(layout)
    engine.register_kv_caches(random_caches(layout))
    tokens = list(range(128))
    engine.store(tokens, random_slots(128), scope="alice")
    assert engine.lookup(tokens, scope="alice") == 128
    assert engine.lookup(tokens, scope="bob") == 0
    assert engine.lookup(tokens) == 0
    mask = engine.retrieve(tokens, random_slots(128), scope="bob")
    assert not mask.any()


class ForgetfulStorage(HostMemoryStorageManager):
    """Answers `contains` for a key it no longer returns (evicted between lookup and get)."""

    def __init__(self, arena: HostArena) -> None:
        super().__init__(arena)
        self.lost: set[ChunkKey] = set()

    def batched_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        got = super().batched_get(keys)
        out: list[MemoryObj | None] = []
        for k, obj in zip(keys, got, strict=True):
            if k in self.lost and obj is not None:
                obj.release()
                obj = None
            out.append(obj)
        return out


def test_retrieve_uses_only_a_contiguous_prefix() -> None:
    layout = make_layout(PagedLayout.LBHNC)
    config = load_config(env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"]})
    storage = ForgetfulStorage(HostArena.create(8 << 20))
    engine = CacheEngine(config, layout, model="m", platform=CPUPlatform(), storage=storage)
    caches = random_caches(layout)
    ref = [c.clone() for c in caches]
    engine.register_kv_caches(caches)
    tokens = list(range(192))
    slots = random_slots(192)
    engine.store(tokens, slots)
    storage.lost.add(engine.full_spans(tokens)[1].key)
    for c in caches:
        c.zero_()
    mask = engine.retrieve(tokens, slots)
    assert mask[:64].all() and not mask[64:].any()  # chunk 2 is present but unusable
    assert_loaded_exactly(layout, caches, ref, slots[:64])
    engine.close()
    assert storage.arena.used_bytes == 0


def test_full_host_memory_skips_the_store() -> None:
    layout = make_layout(PagedLayout.LBHNC)
    per_chunk = layout.chunk_nbytes(CHUNK)
    engine = make_engine(layout, arena_bytes=per_chunk)  # room for one chunk
    engine.register_kv_caches(random_caches(layout))
    tokens = list(range(128))
    # both chunks are in flight at once: one fits, the other is skipped (counted), nothing fails
    assert engine.store(tokens, random_slots(128)) == 64
    assert engine.stats.store_skipped_chunks == 1
    assert engine.lookup(tokens) == 64
    other = list(range(500, 564))
    assert engine.store(other, random_slots(64)) == 64  # evicts the older chunk (LRU)
    assert engine.lookup(other) == 64 and engine.lookup(tokens) == 0


def test_misuse_gets_clear_errors() -> None:
    layout = make_layout(PagedLayout.LBHNC)
    with pytest.raises(ConfigError, match="chunk_size"):
        make_engine(layout, chunk_size=40)
    engine = make_engine(layout)
    with pytest.raises(KVTierError, match="register_kv_caches"):
        engine.store([1, 2], [0, 1])
    with pytest.raises(LayoutError, match="layers"):
        engine.register_kv_caches(random_caches(layout)[:2])
    with pytest.raises(LayoutError, match=r"\[B, H, N, C\]"):
        engine.register_kv_caches([torch.zeros(2, 4, 32, 2, 8, dtype=torch.bfloat16)] * 3)
    with pytest.raises(LayoutError, match="pages"):
        engine.register_kv_caches([torch.zeros(NUM_BLOCKS, 4, BLOCK, 16, dtype=torch.bfloat16)] * 3)
    engine.register_kv_caches(random_caches(layout))
    with pytest.raises(ValueError, match="slot_mapping"):
        engine.store(list(range(64)), list(range(63)))
    # pages move whole: a chunk's slots must fill whole blocks, in order
    with pytest.raises(ValueError, match="whole blocks"):
        engine.store(list(range(64)), list(range(64))[::-1])
    with pytest.raises(ValueError, match="whole blocks"):
        engine.store(list(range(64)), [s + 3 for s in range(64)])
    assert engine.storage.arena.used_bytes == 0  # type: ignore[attr-defined]


def test_cli_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.core.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "bench storage" in out
    assert main(["frobnicate"]) == 2


def test_tail_is_keyed_block_by_block() -> None:
    layout = make_layout(PagedLayout.LBHNC)
    engine = make_engine(layout)
    engine.register_kv_caches(random_caches(layout))
    doc_q1 = list(range(100)) + [7] * 14  # 1 chunk + a 50-token tail: 3 blocks stored (64..112)
    assert engine.store(doc_q1, random_slots(len(doc_q1))) == 112
    doc_q2 = list(range(100)) + [9] * 14  # same document, another question
    assert engine.lookup(doc_q2) == 96  # every whole block the two share
    assert engine.lookup(list(range(100))) == 96
    assert engine.lookup(doc_q1) == 112


def test_hold_keeps_the_prefix_through_eviction() -> None:
    layout = make_layout(PagedLayout.LBHNC)
    per_chunk = layout.chunk_nbytes(CHUNK)
    # three chunks, and room for the alias entries of the held ones (a few hundred bytes each)
    engine = make_engine(layout, arena_bytes=3 * per_chunk + 8 * 256)
    caches = random_caches(layout)
    ref = [c.clone() for c in caches]
    engine.register_kv_caches(caches)
    tokens = list(range(128))
    slots = random_slots(128)
    engine.store(tokens, slots)
    with engine.hold(tokens) as hold:
        assert hold.num_tokens == 128
        # pressure: other prompts take the arena's one free chunk in turn. Eviction skips the
        # held chunks (dropping them would free no bytes), so they stay found and in place.
        for i in range(4):
            other = list(range(1000 * (i + 1), 1000 * (i + 1) + 64))
            engine.store(other, random_slots(64, seed=i + 5))
            assert engine.lookup(other) == 64
        assert engine.lookup(tokens) == 128
        assert engine.lookup(list(range(1000, 1064))) == 0  # the first other prompt was evicted
        for c in caches:
            c.zero_()
        mask = engine.retrieve(tokens, slots, hold=hold)
        assert mask.all()
        assert_loaded_exactly(layout, caches, ref, slots)
        with pytest.raises(ValueError, match="other tokens"):
            engine.retrieve([5, *tokens[1:]], slots, hold=hold)
        with pytest.raises(ValueError, match="other tokens"):
            engine.retrieve(tokens, slots, hold=hold, scope="x")
    assert hold.released
    hold.release()  # idempotent
    with pytest.raises(KVTierError, match="released"):
        engine.retrieve(tokens, slots, hold=hold)
    engine.close()
    assert engine.storage.arena.used_bytes == 0  # type: ignore[attr-defined]

"""A hybrid engine (``KVLayout.groups``: several KV cache groups over the same KV tensors, one
block table each) through ``CacheEngine`` on the CPU platform: every group's pages of a chunk
are stored together and come back into each group's own blocks; a chunk missing one group's
page (vLLM freed a window block) is not stored; a load skips the blocks a group has none of."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.kv_views import replica_views
from kvtier.core import (
    CacheEngine,
    HostArena,
    HostMemoryStorageManager,
    KVLayout,
    PagedLayout,
    load_config,
)
from kvtier.core.platform.cpu import CPUPlatform

BLOCK = 16
CHUNK = 64
NUM_BLOCKS = 64
GROUPS = ("SlidingWindowSpec/32", "FullAttentionSpec")


def layout(paged: PagedLayout = PagedLayout.LBHNC) -> KVLayout:
    return KVLayout(
        num_layers=2,
        num_kv_heads=2,
        head_size=8,
        dtype="bfloat16",
        block_size=BLOCK,
        paged_layout=paged,
        groups=GROUPS,
    )


def engine(lay: KVLayout, views: list[torch.Tensor]) -> CacheEngine:
    config = load_config(env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"]})
    storage = HostMemoryStorageManager(HostArena.create(16 << 20))
    eng = CacheEngine(config, lay, model="test/hybrid", platform=CPUPlatform(), storage=storage)
    eng.register_kv_caches(views)
    return eng


def tables(n_blocks: int, seed: int) -> list[list[int]]:
    """One block table per group, disjoint (a block belongs to one group), never block 0."""
    ids = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1
    ids = ids.tolist()
    return [ids[:n_blocks], ids[n_blocks : 2 * n_blocks]]


def slots(table: list[list[int]], n: int, nulls: int = 0) -> torch.Tensor:
    """``[groups, n]`` slots; the first ``nulls`` blocks of group 0 (the window) have none."""
    pos = torch.arange(n)
    rows = []
    for g, ids in enumerate(table):
        blocks = torch.tensor(ids)[pos // BLOCK]
        row = blocks * BLOCK + pos % BLOCK
        if g == 0:
            row[: nulls * BLOCK] = -1
        rows.append(row)
    return torch.stack(rows)


def filled(lay: KVLayout, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    views = replica_views(lay, NUM_BLOCKS)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=g).to(lay.torch_dtype))
    return views


@settings(max_examples=25, deadline=None)
@given(
    blocks=st.integers(1, 12),
    nulls=st.integers(0, 12),
    seed=st.integers(0, 1000),
    paged=st.sampled_from([PagedLayout.LBHNC, PagedLayout.BLNHC, PagedLayout.LHBNC]),
)
def test_every_groups_pages_come_back_into_each_groups_blocks(
    blocks: int, nulls: int, seed: int, paged: PagedLayout
) -> None:
    """Store a prompt with every group's slots; load it into other tables whose window group
    lacks its first ``nulls`` blocks (as vLLM allocates for a hit): each group's block gets the
    page that group stored there, the skipped ones and every other block stay as they were."""
    lay = layout(paged)
    n = blocks * BLOCK + 1  # the last token is never stored (n - 1 rule of the engine's caller)
    tokens = list(range(7, 7 + n))
    src = filled(lay, seed)
    eng = engine(lay, src)
    before = tables(blocks + 1, seed)
    assert eng.store(tokens, slots(before, n)) == blocks * BLOCK
    original = [v.clone() for v in src]
    after = tables(blocks + 1, seed + 1)
    for v in src:  # another request's KV everywhere
        v.copy_(torch.randn(v.shape).to(lay.torch_dtype))
    untouched = [v.clone() for v in src]
    nulls = min(nulls, blocks)
    mask = eng.retrieve(tokens, slots(after, n, nulls))
    assert int(mask.sum()) == blocks * BLOCK
    written = set()
    for g in range(2):
        for i in range(blocks):
            if g == 0 and i < nulls:
                continue
            b, a = before[g][i], after[g][i]
            written.add(a)
            for layer in range(lay.num_layers):
                assert torch.equal(src[layer][a], original[layer][b]), (g, i, layer)
    for b in set(range(NUM_BLOCKS)) - written:
        for layer in range(lay.num_layers):
            assert torch.equal(src[layer][b], untouched[layer][b]), (b, layer)


def test_a_chunk_missing_a_window_page_is_not_stored() -> None:
    """vLLM freed the window group's first blocks: the chunks holding them cannot be stored
    (their pages are gone), the later chunks are."""
    lay = layout()
    n = 3 * CHUNK + 1
    eng = engine(lay, filled(lay, 0))
    table = tables(3 * CHUNK // BLOCK + 1, 0)
    stored = eng.store(list(range(n)), slots(table, n, nulls=CHUNK // BLOCK + 1))
    assert stored == CHUNK  # chunk 0 and chunk 1 miss window pages; chunk 2 is whole
    assert [eng.storage.contains([s.key])[0] for s in eng.full_spans(list(range(n)))] == [
        False,
        False,
        True,
    ]


def test_a_hybrid_engine_takes_one_row_of_slots_per_group() -> None:
    lay = layout()
    eng = engine(lay, filled(lay, 0))
    with pytest.raises(ValueError, match="one row per KV cache group"):
        eng.store(list(range(CHUNK)), torch.arange(CHUNK))


def test_one_group_layouts_keep_their_chunks_and_keys() -> None:
    """The groups are part of the fingerprint (so of every key); a one-group engine's is the
    one it had before groups existed."""
    hybrid = layout()
    single = dataclasses.replace(hybrid, groups=())
    assert hybrid.fingerprint() != single.fingerprint()
    assert hybrid.chunk_shape(CHUNK)[0] == 2 * single.chunk_shape(CHUNK)[0]


# Gemma 4's geometry: window groups whose blocks are 4x the full-attention group's (vLLM evened
# their pages out); kvtier's block is the window block, holding a section per group.
G4_GROUPS = ("SlidingWindowSpec/32", "SlidingWindowSpec/32", "FullAttentionSpec")
G4_SIZES = (4 * BLOCK, 4 * BLOCK, BLOCK)
G4_UNIT = 4 * BLOCK


def g4_layout(paged: PagedLayout) -> KVLayout:
    return dataclasses.replace(layout(paged), groups=G4_GROUPS, group_block_sizes=G4_SIZES)


def g4_tables(n_tokens: int, seed: int) -> list[list[int]]:
    """One block table per group, each of its own block size, disjoint, never block 0."""
    ids = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1
    out, at = [], 0
    for size in G4_SIZES:
        n = -(-n_tokens // size)
        out.append(ids[at : at + n].tolist())
        at += n
    return out


def g4_slots(table: list[list[int]], n: int, nulls: int = 0) -> torch.Tensor:
    """``[groups, n]`` slots, each group's of its own block size; the window groups' first
    ``nulls`` blocks have none."""
    pos = torch.arange(n)
    rows = []
    for ids, size, kind in zip(table, G4_SIZES, G4_GROUPS, strict=True):
        row = torch.tensor(ids)[pos // size] * size + pos % size
        if kind.startswith("Sliding"):
            row[: nulls * size] = -1
        rows.append(row)
    return torch.stack(rows)


@settings(max_examples=25, deadline=None)
@given(
    blocks=st.integers(1, 5),
    nulls=st.integers(0, 5),
    seed=st.integers(0, 1000),
    paged=st.sampled_from([PagedLayout.LBHNC, PagedLayout.BLNHC]),
)
def test_groups_of_several_block_sizes_come_back_into_their_own_blocks(
    blocks: int, nulls: int, seed: int, paged: PagedLayout
) -> None:
    """Gemma 4's sections: each group's blocks, of its own size, are stored with the kvtier
    block that covers them and come back into that group's blocks of another table (the window
    groups lacking their first ``nulls`` blocks, as vLLM allocates for a hit); the skipped ones
    and every other block stay as they were."""
    lay = g4_layout(paged)
    n = blocks * G4_UNIT + 1
    tokens = list(range(7, 7 + n))
    src = filled(lay, seed)
    eng = engine(lay, src)
    before = g4_tables(n, seed)
    assert eng.store(tokens, g4_slots(before, n)) == blocks * G4_UNIT
    original = [v.clone() for v in src]
    after = g4_tables(n, seed + 1)
    for v in src:  # another request's KV everywhere
        v.copy_(torch.randn(v.shape).to(lay.torch_dtype))
    untouched = [v.clone() for v in src]
    nulls = min(nulls, blocks)
    mask = eng.retrieve(tokens, g4_slots(after, n, nulls))
    assert int(mask.sum()) == blocks * G4_UNIT
    written = set()
    for g, (size, kind) in enumerate(zip(G4_SIZES, G4_GROUPS, strict=True)):
        skipped = nulls * G4_UNIT // size if kind.startswith("Sliding") else 0
        for i in range(blocks * G4_UNIT // size):
            if i < skipped:
                continue
            b, a = before[g][i], after[g][i]
            written.add(a)
            for layer in range(lay.num_layers):
                assert torch.equal(src[layer][a], original[layer][b]), (g, i, layer)
    for b in set(range(NUM_BLOCKS)) - written:
        for layer in range(lay.num_layers):
            assert torch.equal(src[layer][b], untouched[layer][b]), (b, layer)


def test_a_slot_past_its_groups_blocks_is_refused() -> None:
    """Each group's slots are checked against its own block size: a full-attention slot past
    the cache's blocks of 16 tokens is an error even though a window group's slots go higher."""
    lay = g4_layout(PagedLayout.LBHNC)
    eng = engine(lay, filled(lay, 0))
    n = G4_UNIT + 1
    bad = g4_slots(g4_tables(n, 0), n)
    bad[2, 0] = NUM_BLOCKS * BLOCK  # one past the full group's last slot
    with pytest.raises(ValueError, match="out of range"):
        eng.store(list(range(n)), bad)

"""A hybrid engine (``KVLayout.groups``: several KV cache groups over the same KV tensors, one
block table each) through ``CacheEngine`` on the CPU platform: every group's pages of a chunk
are stored together and come back into each group's own blocks; a chunk missing one group's
page (vLLM freed a window block) is not stored; a load skips the blocks a group has none of."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Geometry:
    """A hybrid engine's groups and each one's block size (tokens)."""

    groups: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def unit(self) -> int:  # kvtier's block: the largest here
        return max(self.sizes)

    def layout(self, paged: PagedLayout = PagedLayout.LBHNC) -> KVLayout:
        sizes = self.sizes if len(set(self.sizes)) > 1 else ()
        return dataclasses.replace(layout(paged), groups=self.groups, group_block_sizes=sizes)


# Stage 1: a window group and a full group of one block size. Gemma 4: window groups whose
# blocks are 4x the full group's (vLLM evened their pages out); kvtier's block is the window
# block, holding a section per group.
STAGE1 = Geometry(GROUPS, (BLOCK, BLOCK))
GEMMA4 = Geometry(
    ("SlidingWindowSpec/32", "SlidingWindowSpec/32", "FullAttentionSpec"),
    (4 * BLOCK, 4 * BLOCK, BLOCK),
)


def tables(geo: Geometry, n_tokens: int, seed: int) -> list[list[int]]:
    """One block table per group, each of its own block size, disjoint (a block belongs to one
    group), never block 0."""
    ids = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1
    out, at = [], 0
    for size in geo.sizes:
        n = -(-n_tokens // size)
        out.append(ids[at : at + n].tolist())
        at += n
    return out


def slots(geo: Geometry, table: list[list[int]], n: int, nulls: int = 0) -> torch.Tensor:
    """``[groups, n]`` slots, each group's of its own block size; the window groups have none
    for their blocks before token ``nulls * geo.unit``."""
    pos = torch.arange(n)
    rows = []
    for ids, size, kind in zip(table, geo.sizes, geo.groups, strict=True):
        row = torch.tensor(ids)[pos // size] * size + pos % size
        if kind.startswith("Sliding"):
            row[: nulls * geo.unit] = -1
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
    geo=st.sampled_from([STAGE1, GEMMA4]),
    blocks=st.integers(1, 5),
    nulls=st.integers(0, 5),
    seed=st.integers(0, 1000),
    paged=st.sampled_from([PagedLayout.LBHNC, PagedLayout.BLNHC, PagedLayout.LHBNC]),
)
def test_every_groups_pages_come_back_into_each_groups_blocks(
    geo: Geometry, blocks: int, nulls: int, seed: int, paged: PagedLayout
) -> None:
    """Store a prompt with every group's slots; load it into other tables whose window groups
    lack their first ``nulls`` kvtier blocks (as vLLM allocates for a hit): each group's block,
    of its own size, gets the page that group stored there, the skipped ones and every other
    block stay as they were. With Gemma 4's geometry a kvtier block holds a section per group."""
    lay = geo.layout(paged)
    n = blocks * geo.unit + 1  # the last token is never stored (the engine caller's n - 1 rule)
    tokens = list(range(7, 7 + n))
    src = filled(lay, seed)
    eng = engine(lay, src)
    before = tables(geo, n, seed)
    assert eng.store(tokens, slots(geo, before, n)) == blocks * geo.unit
    original = [v.clone() for v in src]
    after = tables(geo, n, seed + 1)
    for v in src:  # another request's KV everywhere
        v.copy_(torch.randn(v.shape).to(lay.torch_dtype))
    untouched = [v.clone() for v in src]
    nulls = min(nulls, blocks)
    mask = eng.retrieve(tokens, slots(geo, after, n, nulls))
    assert int(mask.sum()) == blocks * geo.unit
    written = set()
    for g, (size, kind) in enumerate(zip(geo.sizes, geo.groups, strict=True)):
        skipped = nulls * geo.unit // size if kind.startswith("Sliding") else 0
        for i in range(skipped, blocks * geo.unit // size):
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
    table = tables(STAGE1, n, 0)
    stored = eng.store(list(range(n)), slots(STAGE1, table, n, nulls=CHUNK // BLOCK + 1))
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


def test_a_slot_past_its_groups_blocks_is_refused() -> None:
    """Each group's slots are checked against its own block size: a window group's slots in the
    cache's last block (of 64 tokens) go past every slot of the full group's 16-token blocks
    and are fine; a full-attention slot one past its last is an error."""
    lay = GEMMA4.layout()
    eng = engine(lay, filled(lay, 0))
    n = GEMMA4.unit + 1
    # The cache's last blocks for the window groups: slots past NUM_BLOCKS * BLOCK.
    good = slots(GEMMA4, [[63, 61], [62, 60], [1, 2, 3, 4, 5]], n)
    assert int(good[0].max()) >= NUM_BLOCKS * BLOCK
    assert eng.store(list(range(n)), good) == GEMMA4.unit
    bad = slots(GEMMA4, tables(GEMMA4, n, 1), n)
    bad[2, 0] = NUM_BLOCKS * BLOCK  # one past the full group's last slot
    with pytest.raises(ValueError, match="out of range"):
        eng.store(list(range(n)), bad)

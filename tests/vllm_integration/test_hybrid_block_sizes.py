"""Groups of several block sizes (Gemma 4: window groups of 256-token blocks beside a
full-attention group of 32, pages of one size), the pieces that need no engine: kvtier's block
(``CacheGroups.hit_block``), each spec's block ids per group (``HybridBlocks.attach``), the
fence and KV events at each group's own block size, which groups count as evened
(``layout.evened_groups``) and which registered views share their pages
(``group_views.shared_views``). test_e2e_hybrid.py runs such a model through vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_hybrid_groups import _output, config, full, sliding

from kvtier.core.errors import LayoutError
from kvtier.vllm_integration.groups import CacheGroups, cache_groups
from kvtier.vllm_integration.messages import KVTierMetadata, SaveSpec, spec_slots
from kvtier.vllm_integration.scheduler.hybrid import HybridBlocks

pytestmark = [pytest.mark.vllm]


def gemma4_window(window: int = 64):
    """A window group as vLLM gives Gemma 4 one: head 64, block 256 (its page the size of a
    full-attention page of head 512 and block 32)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=window
    )


def gemma4_full():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=512, dtype=torch.bfloat16)


def gemma4_groups() -> CacheGroups:
    return cache_groups(config(gemma4_window(), gemma4_window(), gemma4_full(), layers=1))


def test_groups_of_several_block_sizes_hit_at_their_common_block() -> None:
    """Gemma 4: two window groups of 256-token blocks and a full group of 32: kvtier's block
    is 256 tokens; groups of one block size keep vLLM's block size and no sizes."""
    groups = gemma4_groups()
    assert groups.block_sizes == (256, 256, 32) and groups.primary == 2
    assert groups.hit_block(32) == 256
    same = cache_groups(config(sliding(), full()))
    assert same.block_sizes == () and same.hit_block(32) == 32
    # A freed window block of 256 tokens: nothing before token 256 is stored any more.
    assert groups.live_from([[0, 4], [5, 6], [7] * 16], 32) == 256


@given(end=st.integers(1, 1000), load=st.booleans())
def test_each_group_gets_its_own_blocks_for_a_specs_tokens(end: int, load: bool) -> None:
    """A spec's groups carry, per group, the blocks of its own size that hold the spec's
    tokens (a load's ``end``, a save's tokens), and its primary ids are the full group's."""
    from kvtier.vllm_integration.messages import LoadSpec

    groups = gemma4_groups()
    hybrid = HybridBlocks(groups, 256)
    live = [list(range(100, 104)), list(range(200, 204)), list(range(300, 332))]
    tokens = np.zeros(1024, dtype=np.int64)
    spec: LoadSpec | SaveSpec = (
        LoadSpec("r", tokens, live[2], 0, end, None)
        if load
        else SaveSpec("r", tokens[:end], live[2][:1], 0, None)
    )
    hybrid.attach(spec, live)
    windows = -(-end // 256)
    assert spec.groups == [live[0][:windows], live[1][:windows], live[2][: -(-end // 32)]]
    assert spec.block_ids == live[2][: -(-end // 32)]
    slots = spec_slots(spec.block_ids, spec.groups, (256, 256, 32), end, 0, end)
    assert (slots[0] // 256 == np.repeat(live[0][:windows], 256)[:end]).all()
    assert (slots[2] // 32 == np.repeat(live[2], 32)[:end]).all()


def test_the_fence_reads_each_groups_blocks_at_its_own_size() -> None:
    """A new request that vLLM's prefix cache hit for 256 tokens writes the window groups'
    blocks from index 1 and the full group's from index 8: a window block a save still reads
    is reused (drain) only when it is past the hit in its own group."""
    hybrid = HybridBlocks(gemma4_groups(), 256)
    step1 = KVTierMetadata(step=1, saves=[_save_g4([[5, 6], [7, 8], list(range(10, 26))])])
    hybrid.fence(step1, _output(), copied_through=0)
    step2 = KVTierMetadata(step=2)
    # The hit's blocks (5, 7 and the full group's 10-17) are read, not written.
    hit = ([5, 40], [7, 41], [*range(10, 18), *range(60, 68)])
    hybrid.fence(step2, _output(new=[hit], computed=256), copied_through=0)
    assert not step2.drain_saves
    step3 = KVTierMetadata(step=3)
    hybrid.fence(step3, _output(new=[([70, 6], [71, 72], list(range(80, 96)))], computed=256), 0)
    assert step3.drain_saves  # 6: the second window block, written


def _save_g4(groups):
    return SaveSpec("r", np.zeros(512, dtype=np.int64), groups[2], 0, None, groups)


def test_kv_events_name_each_groups_own_blocks() -> None:
    """Where the groups' blocks differ in size, each group's event names its own blocks: the
    hash vLLM gives a block of that size (the request's hash at its last 32-token boundary),
    with that block size."""
    from kvtier.vllm_integration.scheduler.events import EventLog

    groups = gemma4_groups()
    request = SimpleNamespace(
        block_hashes=[bytes([i]) * 32 for i in range(24)],
        lora_request=None,
        all_token_ids=list(range(768)),
    )
    log = EventLog(
        256, True, lambda h, scope: h.hex(), groups.event_specs, (), groups.block_sizes, 32
    )
    log.expect(request, [(b"\x01", 256, 512)], None)
    log.stored("local_cpu", ["01"])
    stored = log.take()
    assert [(e.group_idx, e.block_size) for e in stored] == [(0, 256), (1, 256), (2, 32)]
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    def h(i: int):
        return maybe_convert_block_hash(bytes([i]) * 32)

    assert stored[0].block_hashes == [h(15)]  # tokens 256-511: hash 15 covers them all
    assert stored[2].block_hashes == [h(i) for i in range(8, 16)]
    assert all(e.parent_block_hash == h(7) for e in stored)


def test_only_groups_of_another_geometry_are_evened() -> None:
    """Full and sliding-window groups of one geometry keep their names, so their fingerprint
    and stored chunks (differing in kind is not a geometry); a head size, block size or
    interior writer of its own makes the groups evened (each named with its geometry)."""
    from kvtier.vllm_integration.layout import CacheSpec, evened_groups

    full = CacheSpec(32, 2, 64, 256, False, "FullAttentionSpec")
    window = CacheSpec(32, 2, 64, 256, False, "SlidingWindowSpec")
    gemma4_full = CacheSpec(32, 2, 512, 2048, False, "FullAttentionSpec")
    gemma4_window = CacheSpec(256, 2, 64, 256, False, "SlidingWindowSpec")
    assert not evened_groups([window, full], ["CPU_ATTN/vec"] * 2)
    assert evened_groups([gemma4_window, gemma4_full], ["CPU_ATTN/vec"] * 2)
    assert evened_groups([window, full], ["CPU_ATTN/vec", "CPU_ATTN/vec16"])


def _views(order: str, shapes: list[tuple[int, int, int]], blocks: int = 8) -> list[torch.Tensor]:
    """Logical ``[B, H, N, C]`` views over one buffer of ``blocks`` pages, one per shape
    ``(H, N, C)`` (every page the same bytes), laid out ``NHD`` (a block's page one run,
    token-major) or ``head-outer`` (one run per head, heads across the blocks)."""
    page = shapes[0][0] * shapes[0][1] * shapes[0][2]
    buf = torch.zeros(blocks * page, dtype=torch.bfloat16)
    out = []
    for h, n, c in shapes:
        assert h * n * c == page
        if order == "NHD":
            strides = (page, c, h * c, 1)
        else:  # heads outermost: [H, B, N, C] in memory
            strides = (n * c, blocks * n * c, c, 1)
        out.append(buf.as_strided((blocks, h, n, c), strides))
    return out


@pytest.mark.parametrize("order", ["NHD", "head-outer"])
def test_evened_groups_share_a_view_only_where_each_page_is_one_run(order: str) -> None:
    """Gemma 4's window and full views over one allocation: in an NHD layout (vLLM's default
    for backends that declare none, FlashAttention's) each block's page is one run of bytes in
    both views, so the mover reads the window group's pages through the full group's view; in
    a head-outer layout a block is one run per head, which two head counts would split apart:
    refused by name."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvtier.vllm_integration.group_views import shared_views

    window = SlidingWindowSpec(
        block_size=512, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=64
    )
    full_spec = FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=512, dtype=torch.bfloat16
    )
    cfg = config(window, full_spec, layers=1)
    names = [g.layer_names[0] for g in cfg.kv_cache_groups]
    views = _views(order, [(1, 512, 128), (2, 32, 1024)])  # pages of 64 Ki elements each
    caches = dict(zip(names, views, strict=True))
    if order == "NHD":
        reps, position = shared_views(cfg, caches, 1, evened=True)
        assert reps == [names[1]] and position == {names[0]: 0, names[1]: 0}
    else:
        with pytest.raises(LayoutError, match="do not share their pages"):
            shared_views(cfg, caches, 1, evened=True)

"""The pieces of hybrid-model support that need no engine: which KV cache groups kvtier takes
(``groups.py``, named refusals for the rest), what a hybrid model cannot run with
(``groups.check_hybrid``), slots of freed window blocks, and the scheduler's fence for window
blocks vLLM reuses while a save may still read them (``scheduler/hybrid.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError, LayoutError
from kvtier.vllm_integration.groups import CacheGroups, cache_groups, check_hybrid
from kvtier.vllm_integration.messages import KVTierMetadata, SaveSpec, spec_slots
from kvtier.vllm_integration.scheduler.hybrid import HybridBlocks

pytestmark = [pytest.mark.vllm]


def full(**kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **kw
    )


def sliding(window: int = 64):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=window
    )


def config(*specs, layers: int = 2):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [
        KVCacheGroupSpec([f"model.layers.{g + len(specs) * i}.attn" for i in range(layers)], s)
        for g, s in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_one_group_is_not_hybrid() -> None:
    assert cache_groups(config(full())) == CacheGroups()
    assert not cache_groups(None).hybrid


def test_a_window_only_group_is_tracked_also_when_vllm_wraps_its_layers_specs() -> None:
    """One sliding-window group (every layer windowed) is not hybrid but its freed blocks are
    tracked, also when vLLM wraps per-layer specs of different windows in one group."""
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        UniformTypeKVCacheSpecs,
    )

    plain = cache_groups(config(sliding(64)))
    assert not plain.hybrid and plain.tracked and plain.window_sizes == (64,)
    assert plain.rows == (0,)  # its one group's pages are a chunk's
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    wrapped = UniformTypeKVCacheSpecs(
        block_size=32, kv_cache_specs={names[0]: sliding(128), names[1]: sliding(64)}
    )
    one = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, wrapped)]
    )
    groups = cache_groups(one)
    assert groups.tracked and groups.window_sizes == (64,)


def test_sliding_and_full_groups_are_taken_with_the_full_one_primary() -> None:
    groups = cache_groups(config(sliding(128), full()))
    assert groups.kinds == ("SlidingWindowSpec/128", "FullAttentionSpec")
    assert groups.primary == 1 and groups.windows == (0,)


def mamba(mode: str = "align", **kw):
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=32, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode=mode, **kw
    )


def test_groups_kvtier_cannot_store_are_named() -> None:
    with pytest.raises(LayoutError, match="KV cache groups") as exc:
        cache_groups(config(sliding(64), sliding(128)))  # no full-attention group
    assert "full-attention, sliding-window attention or Mamba" in str(exc.value)


@pytest.mark.parametrize(
    "specs, why",
    [
        ((mamba("none"), full()), "mamba_cache_mode is 'none'"),
        ((mamba(num_speculative_blocks=1), full()), "speculative decoding"),
        ((mamba(), sliding(), full()), "sliding-window layers or several attention groups"),
    ],
    ids=["prefix-caching-off", "speculative", "mamba-and-window"],
)
def test_mamba_groups_kvtier_cannot_store_are_named(specs, why) -> None:
    with pytest.raises(LayoutError, match="cannot store its Mamba groups") as exc:
        cache_groups(config(*specs))
    assert why in str(exc.value) and "without kvtier" in str(exc.value)


def test_an_align_mamba_group_beside_full_attention_is_taken_as_states() -> None:
    groups = cache_groups(config(mamba(), full()))
    assert groups.kinds == ("MambaSpec/mamba2/4x8:float32", "FullAttentionSpec")
    assert groups.mambas == (0,) and groups.rows == (1,) and groups.primary == 1
    assert groups.tracked and groups.hybrid and not groups.windows


@pytest.mark.parametrize("field, value", [("offload", "lazy"), ("lookup", "index")])
def test_a_mamba_hybrid_refuses_what_it_cannot_run_by_name(field, value) -> None:
    cfg = load_config(env={}, overrides={field: value, "load_async": True})
    with pytest.raises(ConfigError, match=field) as exc:
        check_hybrid(cfg, cache_groups(config(mamba(), full())))
    assert "Mamba" in str(exc.value)


def _offers(offers: dict) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offers))


def test_offered_states_are_saved_at_chunk_boundaries_by_the_offered_block() -> None:
    """vLLM's offers name ``(group, block, boundary)``; kvtier keeps those at full-chunk
    boundaries within the prompt where every Mamba group offered a block."""
    hybrid = HybridBlocks(cache_groups(config(mamba(), mamba(), full())), 32)
    hybrid.take_offers(_offers({
        "r": [(0, 7, 64), (1, 8, 64), (0, 9, 96), (1, 10, 96), (0, 11, 128), (1, 12, 128),
              (0, 13, 192)],
        "s": [(0, 3, 64), (1, 4, 64)],
    }))  # fmt: skip
    assert hybrid.states("r", 64, 1000) == [(64, [7, 8]), (128, [11, 12])]  # 96: not a chunk
    assert hybrid.states("r", 64, 127) == [(64, [7, 8])]  # 128 is past the prompt
    assert hybrid.states("s", 32, 1000) == [(64, [3, 4])]
    assert hybrid.states("t", 32, 1000) == []
    hybrid.take_offers(_offers({}))  # a step's offers are that step's only
    assert hybrid.states("r", 64, 1000) == []


def test_a_load_names_the_block_vllm_gave_for_the_state_at_its_end() -> None:
    from kvtier.vllm_integration.messages import LoadSpec

    hybrid = HybridBlocks(cache_groups(config(mamba(), full())), 32)
    load = LoadSpec("r", np.zeros(100, dtype=np.int64), [20, 21, 22], 0, 64, None)
    hybrid.attach(load, [[0, 14, 16], [20, 21, 22, 23]])
    assert load.groups == [[20, 21, 22]] and load.states == [14]  # index 64 / 32 - 1
    short = LoadSpec("r", np.zeros(100, dtype=np.int64), [20, 21], 0, 32, None)
    hybrid.attach(short, [[0, 14, 16], [20, 21, 22, 23]])
    assert short.states is None  # vLLM's null block: no state block given, nothing loads


def test_an_offered_state_block_reused_or_written_before_its_copy_drains_the_workers() -> None:
    """Step 1 saves the state offered in block 7; step 2 hands 7 to another request before a
    worker reported step 1 copied: a drain. A state block a scheduled request writes in place
    (its running state, the last Mamba block) counts as written too."""
    hybrid = HybridBlocks(cache_groups(config(mamba(), full())), 32)
    save = SaveSpec("r", np.zeros(64, dtype=np.int64), [1, 2], 0, None, [[1, 2]], [(64, [7])])
    step1 = KVTierMetadata(step=1, saves=[save])
    hybrid.take_offers(_offers({}))
    hybrid.fence(step1, _output(), copied_through=0)
    assert not step1.drain_saves
    step2 = KVTierMetadata(step=2)
    hybrid.take_offers(_offers({}))
    hybrid.fence(step2, _output(new=[([7], [30])]), copied_through=0)
    assert step2.drain_saves
    step3 = KVTierMetadata(step=3, saves=[save])
    hybrid.take_offers(_offers({}))
    hybrid.fence(step3, _output(), copied_through=2)
    manager = SimpleNamespace(get_block_ids=lambda rid: ([0, 7], [1, 2]))
    hybrid.bind(manager)  # type: ignore[arg-type]
    step4 = KVTierMetadata(step=4)
    hybrid.take_offers(_offers({}))
    hybrid.refresh("r")  # its running state is block 7
    hybrid.fence(step4, _output(), copied_through=2)
    assert step4.drain_saves and hybrid.drains == 2


def test_groups_of_unequal_layer_counts_are_named() -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [
        KVCacheGroupSpec(["model.layers.0.attn", "model.layers.2.attn"], sliding()),
        KVCacheGroupSpec(["model.layers.1.attn"], full()),
    ]
    with pytest.raises(LayoutError, match=r"layers per group \[1, 2\]"):
        cache_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups))


@pytest.mark.parametrize(
    "field, value",
    [("offload", "lazy"), ("use_layerwise", True), ("load_async", False)],
)
def test_a_hybrid_model_refuses_what_it_cannot_run_by_name(field, value) -> None:
    groups = cache_groups(config(sliding(), full()))
    cfg = load_config(env={}, overrides={field: value})
    with pytest.raises(ConfigError, match=field) as exc:
        check_hybrid(cfg, groups)
    assert "SlidingWindowSpec/64, FullAttentionSpec" in str(exc.value)
    check_hybrid(cfg, CacheGroups())  # one group: all of them are fine


@given(nulls=st.integers(0, 6), start=st.integers(0, 6 * 32), length=st.integers(1, 6 * 32))
def test_freed_window_blocks_have_no_slots(nulls: int, start: int, length: int) -> None:
    """Slots per group; vLLM's null block (0) in the window group's table means "no page"."""
    start = min(start, length)
    window = [0] * nulls + list(range(10, 16 - nulls))
    primary = list(range(20, 26))
    slots = spec_slots(primary, [window, primary], [32, 32], length, start, length)
    assert slots.shape == (2, length)
    pos = np.arange(length)
    want_full = np.where(pos >= start, np.array(primary)[pos // 32] * 32 + pos % 32, -1)
    assert (slots[1] == want_full).all()
    ids = np.array(window)[pos // 32]
    want_window = np.where((pos >= start) & (ids != 0), ids * 32 + pos % 32, -1)
    assert (slots[0] == want_window).all()


def _output(new=(), cached=(), computed=0):
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(block_ids=ids, num_computed_tokens=computed) for ids in new
        ],
        scheduled_cached_reqs=SimpleNamespace(new_block_ids=list(cached)),
    )


def _save(step_groups):
    return SaveSpec("r", np.zeros(64, dtype=np.int64), step_groups[1], 0, None, step_groups)


def test_a_reused_window_block_still_being_saved_drains_the_workers() -> None:
    """A save of step 1 reads window blocks 5 and 6; step 2 hands block 6 to another request
    before any worker reported step 1 copied: the workers drain. Once step 1 is copied, or
    for a full-attention block (never freed while its request runs), no drain."""
    hybrid = HybridBlocks(cache_groups(config(sliding(), full())), 32)
    step1 = KVTierMetadata(step=1, saves=[_save([[5, 6], [7, 8]])])
    hybrid.fence(step1, _output(), copied_through=0)
    assert not step1.drain_saves
    step2 = KVTierMetadata(step=2)
    hybrid.fence(step2, _output(cached=[([6], [9])]), copied_through=0)
    assert step2.drain_saves and hybrid.drains == 1
    step3 = KVTierMetadata(step=3)
    hybrid.fence(step3, _output(new=[([5], [7])]), copied_through=1)  # step 1 copied
    assert not step3.drain_saves
    step4 = KVTierMetadata(step=4, saves=[_save([[0, 11], [12, 13]])])  # 0: vLLM's null block
    hybrid.fence(step4, _output(), copied_through=3)
    step5 = KVTierMetadata(step=5)
    hybrid.fence(step5, _output(new=[([12], [0])]), copied_through=3)
    assert not step5.drain_saves  # 12 is a full-attention block, 0 is never a real one
    step6 = KVTierMetadata(step=6)
    hybrid.fence(step6, _output(new=[([11, 14], [12, 15])], computed=32), copied_through=3)
    assert not step6.drain_saves  # 11: vLLM's prefix cache hit, read and not written
    assert hybrid.drains == 1


def test_live_from_is_the_first_token_every_window_group_still_has() -> None:
    groups = cache_groups(config(sliding(), full()))
    assert groups.live_from([[0, 0, 3, 4], [5, 6, 7, 8]], 32) == 64
    assert groups.live_from([[1, 2], [5, 6]], 32) == 0


def test_kv_events_of_a_hybrid_model_name_every_group() -> None:
    """A stored chunk of a hybrid model is announced once per KV cache group, with the
    group's index, spec kind and window (as vLLM's own hybrid events); its removal too. One
    group keeps one event without group fields."""
    from kvtier.vllm_integration.scheduler.events import EventLog

    groups = cache_groups(config(sliding(64), full()))
    assert groups.event_specs == (("sliding_window", 64), ("full_attention", None))
    request = SimpleNamespace(
        block_hashes=[bytes([i]) * 32 for i in range(4)],
        lora_request=None,
        all_token_ids=list(range(128)),
    )
    hybrid = EventLog(32, True, lambda h, scope: h.hex(), groups.event_specs)
    single = EventLog(32, True, lambda h, scope: h.hex())
    for log in (hybrid, single):
        log.expect(request, [(b"\x01", 0, 64)], None)
        log.stored("local_cpu", ["01"])
        log.removed("local_cpu", ["01"])
    events = hybrid.take()
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    fields = [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored]
    assert fields == [(0, "sliding_window", 64), (1, "full_attention", None)]
    assert all(len(e.block_hashes) == 2 and e.ownership == "kvtier" for e in stored)
    assert [e.group_idx for e in removed] == [0, 1]
    events = single.take()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved"]
    assert events[0].group_idx is None and events[1].group_idx is None


def test_a_chunk_larger_than_the_window_is_warned_about(caplog) -> None:
    """Chunks larger than the smallest window lose chunks to freed window blocks: said at
    start (once, by the scheduler side), naming both sizes; a chunk within the window is not
    warned about."""
    groups = cache_groups(config(sliding(64), full()))
    with caplog.at_level("WARNING", logger="kvtier"):
        check_hybrid(load_config(env={}, overrides={"chunk_size": 256}), groups)
        assert "chunk_size 256" in caplog.text and "(64 tokens)" in caplog.text
        caplog.clear()
        check_hybrid(load_config(env={}, overrides={"chunk_size": 64}), groups)
        assert caplog.text == ""
        check_hybrid(load_config(env={}, overrides={"chunk_size": 256}), groups, warn=False)
        assert caplog.text == ""  # a worker's connector: the scheduler's has said it


@pytest.mark.parametrize("stateful", [False, True], ids=["attention", "mamba"])
def test_a_short_probe_answer_forgets_chunks_only_without_states(stateful) -> None:
    """A probe that finds fewer tokens than the index promised makes the scheduler forget the
    chunk after them, unless the model has Mamba groups: its probes stop where a state entry
    ends the hit, which says nothing of the chunks after it (forgetting them would keep later
    prompts with a state further on from being probed)."""
    from kvtier.vllm_integration.messages import ProbeAnswer
    from kvtier.vllm_integration.scheduler.lookups import Lookups
    from kvtier.vllm_integration.scheduler.prompts import Probe

    forgotten: list = []
    index = SimpleNamespace(forget=lambda rank, hashes, scope: forgotten.extend(hashes))
    lookups = Lookups(load_config(env={}), index, 1, stateful=stateful)  # type: ignore[arg-type]
    hashes = SimpleNamespace(missing_after=lambda hit: [b"next"], scope=None)
    state = SimpleNamespace(probe=Probe(7, 0.0), hashes=hashes)
    lookups.answer(state, 0, ProbeAnswer("r", 7, 0))  # type: ignore[arg-type]
    assert state.probe.answers == {0: 0}
    assert forgotten == ([] if stateful else [b"next"])


def test_the_default_chunk_size_follows_vllms_block_size() -> None:
    """The default 256 becomes the next multiple of a block size that does not divide it, and
    a Mamba hybrid's block size (states are offered at block boundaries, stored at chunk
    boundaries); a chunk size the user set is kept, or refused by name when not a multiple."""
    from kvtier.vllm_integration.groups import hybrid_chunk_size

    default = load_config(env={})
    assert hybrid_chunk_size(default, 16, explicit=False) == 256
    assert hybrid_chunk_size(default, 160, explicit=False) == 320
    assert hybrid_chunk_size(default, 160, explicit=False, states=True) == 160
    assert hybrid_chunk_size(default, 544, explicit=False, states=True) == 544
    set_ = load_config(env={}, overrides={"chunk_size": 1088})
    assert hybrid_chunk_size(set_, 544, explicit=True, states=True) == 1088
    with pytest.raises(ConfigError, match="chunk_size") as exc:
        hybrid_chunk_size(set_, 640, explicit=True, states=True)
    assert "640" in str(exc.value)


def test_a_state_block_a_load_or_a_copy_writes_is_fenced() -> None:
    """A save still reading an offered state block: a later step whose asynchronous load puts
    another request's state into that block, or whose copy-on-write targets it, drains the
    saves first."""
    from kvtier.vllm_integration.messages import LoadSpec

    hybrid = HybridBlocks(cache_groups(config(mamba(), full())), 32)
    save = SaveSpec("r", np.zeros(64, dtype=np.int64), [1, 2], 0, None, [[1, 2]], [(64, [70])])
    hybrid.take_offers(_offers({}))
    hybrid.fence(KVTierMetadata(step=1, saves=[save]), _output(), copied_through=0)
    load = LoadSpec("s", np.zeros(100, dtype=np.int64), [5, 6], 0, 64, None, 1, True, [[5, 6]])
    load.states = [70]
    step2 = KVTierMetadata(step=2, loads=[load])
    hybrid.take_offers(_offers({}))
    hybrid.fence(step2, _output(), copied_through=0)
    assert step2.drain_saves
    copy = SimpleNamespace(src_block_id=3, dst_block_id=70)
    step3 = KVTierMetadata(step=3)
    out = _output()
    out.kv_cache_block_copies = [copy]
    hybrid.take_offers(_offers({}))
    hybrid.fence(step3, out, copied_through=0)
    assert step3.drain_saves and hybrid.drains == 2


def test_ranks_that_found_different_hits_disagree() -> None:
    """A Mamba hybrid's hit needs every rank to hold the state at the same boundary (each
    rank's hold keeps only the state at its own hit's end): the scheduler takes a hit only
    from ranks that agree (``Probe.agreed``), else a miss."""
    from kvtier.vllm_integration.scheduler.prompts import Probe

    assert Probe(1, 0.0, {0: 1088, 1: 1088}).agreed
    split = Probe(1, 0.0, {0: 1088, 1: 544})
    assert not split.agreed and split.hit == 544  # what an attention-only model would load

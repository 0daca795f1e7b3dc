"""Verification by recompute (``kvtier.core.verify``) on the CPU platform: stored chunks
compared with KV "recomputed" in the cache. Rounding-sized differences pass; another prompt's
KV, another layer's, or pages packed another way are caught, removed from storage and their
tier quarantined; blocks the engine did not compute (-1 slots) are not compared."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import BLOCK, CHUNK, make_engine, make_layout, random_caches, random_slots

from kvtier.core import KVLayout, PagedLayout
from kvtier.core.verify import DEFAULT_TOLERANCE, Verifier, page_errors, verify_dtype

TOKENS = list(range(1000, 1000 + 2 * CHUNK + 2 * BLOCK))  # two chunks and two tail blocks


def setup(layout: KVLayout, **cfg):
    engine = make_engine(layout, **cfg)
    caches = random_caches(layout)
    engine.register_kv_caches(caches)
    slots = random_slots(len(TOKENS))
    assert engine.store(TOKENS, slots) == len(TOKENS)
    return engine, caches, slots


def rounded(x: torch.Tensor, ulps: int) -> torch.Tensor:
    """``x`` moved by up to ``ulps`` units in the last place, at random (a recompute's rounding)."""
    bits = {2: torch.int16, 4: torch.int32}[x.element_size()]
    noise = torch.randint(-ulps, ulps + 1, x.shape, dtype=bits)
    return (x.view(bits) + noise).view(x.dtype)


@pytest.mark.parametrize("pl", [PagedLayout.LBHNC, PagedLayout.BHLNC])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_recompute_that_differs_by_rounding_passes(pl, dtype):
    layout = make_layout(pl, dtype)
    engine, caches, slots = setup(layout)
    for c in caches:
        c.copy_(rounded(c, 2))
    verifier = Verifier(engine, tolerance=0, quarantine_s=60)
    with engine.hold(TOKENS) as hold:
        checks = verifier.check(TOKENS, slots, hold)
    assert [c.ok for c in checks] == [True] * 4  # 2 chunks + 2 tail blocks
    assert all(0 < c.error < DEFAULT_TOLERANCE[layout.torch_dtype] / 4 for c in checks)
    assert verifier.values() == {"verify_chunks": {"": 4}, "verify_mismatches": {}}
    assert engine.lookup(TOKENS) == len(TOKENS)
    engine.close()


WRONG = ["other prompt", "other layer", "one block", "packed otherwise"]


@pytest.mark.parametrize("how", WRONG)
def test_wrong_kv_is_caught_removed_and_its_tier_quarantined(how, caplog):
    layout = make_layout(PagedLayout.LBHNC, "bfloat16")
    engine, caches, slots = setup(layout)
    # What the engine "recomputes" now differs from what it stored, in one way:
    b = int(slots[CHUNK]) // BLOCK  # the first block of the second chunk
    if how == "other prompt":
        for c in caches:
            c.copy_(torch.randn(c.shape).to(c.dtype))
    elif how == "other layer":
        caches[0][b], caches[1][b] = caches[1][b].clone(), caches[0][b].clone()
    elif how == "one block":
        caches[2][b].copy_(torch.randn(caches[2][b].shape).to(caches[2].dtype))
    else:  # K of a block packed in pairs of tokens, as another ISA writes it
        page = caches[1][b]
        page.copy_(
            page.reshape(page.shape[0], -1, 2, page.shape[-1]).transpose(1, 2).reshape(page.shape)
        )
    verifier = Verifier(engine, tolerance=0, quarantine_s=60)
    with caplog.at_level(logging.ERROR, logger="kvtier"), engine.hold(TOKENS) as hold:
        keys = [s.key for s in hold.spans]
        checks = verifier.check(TOKENS, slots, hold)
    bad = [c for c in checks if not c.ok]
    assert bad, "the wrong KV passed"
    assert all(c.error > 0.3 for c in bad), [c.error for c in bad]
    if how != "other prompt":
        assert [c.key for c in bad] == [keys[1]], "only the second chunk is wrong"
        assert bad[0].block == 0 and bad[0].layer == {"other layer": 0, "one block": 2}.get(how, 1)
    assert engine.storage.contains([c.key for c in bad]) == [False] * len(bad)
    assert "local_cpu quarantined" in caplog.text and bad[0].key.to_string() in caplog.text
    assert engine.lookup(TOKENS) == 0, "the tier that served it is quarantined"
    assert verifier.values()["verify_mismatches"] == {"local_cpu": len(bad)}
    engine.close()


def test_blocks_the_engine_did_not_compute_are_not_compared():
    layout = make_layout(PagedLayout.LBHNC, "bfloat16")
    engine, caches, slots = setup(layout)
    computed_from = CHUNK + BLOCK  # vLLM's own prefix cache had the first chunk and a block
    for c in caches:  # the blocks before are another prompt's: not a recompute, not compared
        for b in (slots[:computed_from:BLOCK] // BLOCK).tolist():
            c[b].copy_(torch.randn(c[b].shape).to(c.dtype))
    mine = slots.clone()
    mine[:computed_from] = -1
    verifier = Verifier(engine, tolerance=0, quarantine_s=60)
    with engine.hold(TOKENS) as hold:
        checks = verifier.check(TOKENS, mine, hold)
    assert [c.ok for c in checks] == [True] * 3, "chunk 1 (blocks 1-3) and the two tails"
    assert checks[0].block >= 1
    engine.close()


def test_a_configured_tolerance_replaces_the_default():
    layout = make_layout(PagedLayout.LBHNC, "bfloat16")
    engine, caches, slots = setup(layout)
    for c in caches:
        c.copy_(rounded(c, 2))
    verifier = Verifier(engine, tolerance=1e-9, quarantine_s=0)
    with engine.hold(TOKENS) as hold:
        checks = verifier.check(TOKENS, slots, hold)
    assert not any(c.ok for c in checks)
    assert engine.lookup(TOKENS) == 0  # removed; with no quarantine time the tier still serves
    engine.close()


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 64)),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_page_errors_are_zero_for_equal_pages_and_near_one_for_unrelated(dtype, shape, scale, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(shape, generator=g) * scale).to(dtype)
    b = (torch.randn(shape, generator=g) * scale).to(dtype)
    as_bytes = lambda t: t.view(torch.uint8).reshape(shape[0], shape[1], -1)  # noqa: E731
    assert not page_errors(as_bytes(a), as_bytes(a), dtype).any()
    if shape[2] >= 16:
        assert bool((page_errors(as_bytes(a), as_bytes(b), dtype) > 0.3).all())


def test_pages_of_nan_bytes_are_an_infinite_error():
    fresh = torch.ones(1, 1, 8, dtype=torch.bfloat16).view(torch.uint8).reshape(1, 1, -1)
    junk = torch.full_like(fresh, 0xFF)  # bf16 NaNs
    assert page_errors(fresh, junk, torch.bfloat16).item() == float("inf")


def test_which_caches_can_be_verified():
    assert verify_dtype(make_layout(PagedLayout.LBHNC, "bfloat16")) is torch.bfloat16
    fp8 = KVLayout(2, 2, 8, "uint8", BLOCK, cache_dtype="fp8_e5m2", content_bytes=16)
    assert verify_dtype(fp8) is torch.float8_e5m2
    packed = KVLayout(2, 2, 8, "uint8", BLOCK, cache_dtype="int8_per_token", content_bytes=20)
    assert verify_dtype(packed) is None
    engine = make_engine(packed)
    with pytest.raises(NotImplementedError, match="cannot read"):
        Verifier(engine, tolerance=0, quarantine_s=1).check([], [], engine.hold([]))
    engine.close()

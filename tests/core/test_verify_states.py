"""A Mamba hybrid's state entries checked by recompute (``Verifier.check_state``,
``kvtier.core.verify.compare``): the held entry against the state the engine recomputed at the same
boundary, each tensor of the page read as its own element type. A recompute's rounding passes;
another prompt's state, or zeros, is caught, removed and its tier quarantined."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fixtures.kv_views import replica_views
from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.core.verify import Verifier
from kvtier.core.verify.compare import state_parts

BLOCK = 16
CHUNK = 32
# A convolution state in the model's dtype, then an SSM state in fp32 (Gated DeltaNet's shape).
STATES = ("MambaSpec/gdn_attention/3x4:bfloat16,2x4x2:float32",)
PARTS = ((24, torch.bfloat16), (64, torch.float32))
LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_size=8, dtype="bfloat16", block_size=BLOCK, states=STATES
)
PROMPT = list(range(100, 100 + 3 * CHUNK + 7))
STATE_BLOCK, OTHER_BLOCK = 44, 45


def setup() -> tuple[CacheEngine, list[torch.Tensor]]:
    config = load_config(env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"]})
    storage = HostMemoryStorageManager(HostArena.create(16 << 20))
    eng = CacheEngine(config, LAYOUT, model="test/mamba", platform=CPUPlatform(), storage=storage)
    views = replica_views(LAYOUT, 48)
    g = torch.Generator().manual_seed(7)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=g).to(LAYOUT.torch_dtype))
    eng.register_kv_caches(views)
    for v in views:  # real states in the first bytes of each page: finite values of each type
        for offset, (nbytes, dtype) in zip((0, 24), PARTS, strict=True):
            for b in (STATE_BLOCK, OTHER_BLOCK):
                part = page_bytes(v, b)[offset : offset + nbytes].view(dtype)
                part.copy_(torch.randn(part.shape, generator=g).to(dtype))
    n = 2 * CHUNK
    eng.store(PROMPT[:n], torch.arange(BLOCK, BLOCK + n))  # blocks 1.. hold the prompt
    assert eng.store_state(PROMPT, n, [STATE_BLOCK])
    return eng, views


def page_bytes(view: torch.Tensor, block: int) -> torch.Tensor:
    return view[block].view(torch.uint8).reshape(-1)


def rounded(x: torch.Tensor, ulps: int) -> torch.Tensor:
    bits = {2: torch.int16, 4: torch.int32}[x.element_size()]
    noise = torch.randint(-ulps, ulps + 1, x.shape, dtype=bits)
    return (x.view(bits) + noise).view(x.dtype)


def check(eng: CacheEngine, quarantine_s: float = 60):
    verifier = Verifier(eng, tolerance=0, quarantine_s=quarantine_s)
    tokens = PROMPT[: 2 * CHUNK + 5]
    with eng.hold(tokens) as hold:
        assert hold.state is not None and hold.state[0] == 2 * CHUNK
        result = verifier.check_state(tokens, None, hold, [STATE_BLOCK])
    return verifier, result


def test_a_recomputed_state_that_differs_by_rounding_passes() -> None:
    """Each part moved as a recompute in another batch shape moves it: the bf16 part by two
    units in its last place, the fp32 part by a relative 2**-9 (the rounding of the bf16 layers
    before it). Read as bf16, the fp32 part's low halves would change their exponents: noise of
    the size of the values."""
    eng, views = setup()
    g = torch.Generator().manual_seed(3)
    for v in views:
        raw = page_bytes(v, STATE_BLOCK)
        conv = raw[0:24].view(torch.bfloat16)
        conv.copy_(rounded(conv, 2))
        ssm = raw[24:88].view(torch.float32)
        ssm.mul_(1 + 2**-9 * torch.randn(ssm.shape, generator=g))
        raw[88:].copy_(torch.randint(0, 256, raw[88:].shape, dtype=torch.uint8))  # padding
    verifier, result = check(eng)
    assert result is not None and result.ok and result.state, result
    assert 0 < result.error < 0.05
    assert (verifier.states, verifier.values()["verify_mismatches"]) == (1, {})
    assert eng.lookup(PROMPT[: 2 * CHUNK + 5]) == 2 * CHUNK


@pytest.mark.parametrize("how", ["another state", "zeros", "one part wrong"])
def test_a_wrong_state_is_caught_removed_and_its_tier_quarantined(how, caplog) -> None:
    eng, views = setup()
    for v in views:
        raw = page_bytes(v, STATE_BLOCK)
        if how == "another state":
            raw[:88].copy_(page_bytes(v, OTHER_BLOCK)[:88])
        elif how == "zeros":
            raw[:88].zero_()
        else:  # the SSM state of another request, the convolution state right
            raw[24:88].copy_(page_bytes(v, OTHER_BLOCK)[24:88])
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        verifier, result = check(eng, quarantine_s=0.2)
    assert result is not None and not result.ok and result.error > 0.3, result
    assert verifier.values()["verify_mismatches"] == {"local_cpu": 1}
    assert "state entry" in caplog.text and "local_cpu quarantined" in caplog.text
    assert eng.storage.quarantined.blocked("local_cpu")  # type: ignore[attr-defined]
    time.sleep(0.3)  # the quarantine is over: what is stored is seen again
    assert eng.lookup(PROMPT[: 2 * CHUNK + 5]) == 0  # no state, no hit
    assert eng.states is not None
    key = eng.states.key(eng.spans.prompt(PROMPT, None), 2 * CHUNK)
    assert eng.storage.contains([key]) == [False], "the entry is gone, not only hidden"
    assert eng.store_state(PROMPT, 2 * CHUNK, [STATE_BLOCK]), "stored afresh by the next save"


def test_a_state_kind_that_does_not_name_its_tensors_is_not_compared() -> None:
    eng, _ = setup()
    other = Verifier(eng, tolerance=0, quarantine_s=60)
    object.__setattr__(eng, "layout", LAYOUT.__class__(**{**LAYOUT.__dict__, "states": ("X",)}))
    tokens = PROMPT[: 2 * CHUNK + 5]
    with eng.hold(tokens) as hold:
        assert other.check_state(tokens, None, hold, [STATE_BLOCK]) is None


DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(1, 9), min_size=1, max_size=3), st.sampled_from(list(DTYPES))
        ),
        min_size=1,
        max_size=3,
    )
)
def test_state_parts_are_read_from_the_kind(parts) -> None:
    listed = ",".join(f"{'x'.join(map(str, shape))}:{dt}" for shape, dt in parts)
    got = state_parts(f"MambaSpec/gdn_attention/{listed}")
    assert got is not None
    assert [n for n, _ in got] == [DTYPES[dt] * torch.Size(shape).numel() for shape, dt in parts]
    assert [str(d).removeprefix("torch.") for _, d in got] == [dt for _, dt in parts]


@pytest.mark.parametrize(
    "kind",
    ["FullAttentionSpec", "MambaSpec/gdn", "MambaSpec/gdn/3x4:int4", "MambaSpec/x/ax2:bfloat16"],
)
def test_kinds_that_name_no_tensors(kind) -> None:
    assert state_parts(kind) is None

"""Bad input to the engine is a ``ValueError`` naming the problem, never a silent wrong key
(a float token truncated, a uint64 that wraps, a bool taken for 0/1) or a raw torch error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
from kvtier.core.keys import prefix_hashes, token_bytes
from kvtier.core.platform.cpu import CPUPlatform

BLOCK, CHUNK, NUM_BLOCKS = 16, 32, 8
LAYOUT = KVLayout(
    num_layers=2,
    num_kv_heads=2,
    head_size=8,
    dtype="float32",
    block_size=BLOCK,
    paged_layout="LBHNC",
)


@pytest.fixture
def engine():
    config = load_config(env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"]})
    e = CacheEngine(
        config,
        LAYOUT,
        model="m",
        platform=CPUPlatform(),
        storage=HostMemoryStorageManager(HostArena.create(4 << 20)),
    )
    e.register_kv_caches(
        [torch.randn(LAYOUT.expected_cache_shape(NUM_BLOCKS)) for _ in range(LAYOUT.num_layers)]
    )
    yield e
    e.close()


BAD_TOKENS = {
    "float list": [1.0, 2.0, 3.0],
    "float array": np.arange(64, dtype=np.float64) + 0.5,
    "float tensor": torch.arange(64, dtype=torch.float32),
    "bool array": np.ones(64, dtype=bool),
    "bool tensor": torch.ones(64, dtype=torch.bool),
    "bool list": [True, False] * 32,
    "bool among ints": [1, 2, True, 4],
    "uint64 past int64": np.array([1, 2**63 + 5], dtype=np.uint64),
    "int past uint64": [1, 2**70],
    "negative": [5, -1, 7],
    "negative tensor": torch.tensor([5, -3]),
    "strings": ["1", "2"],
}


@pytest.mark.parametrize("name", sorted(BAD_TOKENS))
def test_bad_token_arrays_are_value_errors(engine, name):
    tokens = BAD_TOKENS[name]
    with pytest.raises(ValueError, match="token"):
        token_bytes(tokens)
    with pytest.raises(ValueError, match="token"):
        engine.lookup(tokens)
    with pytest.raises(ValueError, match="token"):
        engine.store(tokens, torch.arange(len(tokens)))


def test_good_token_arrays_hash_alike():
    ids = [0, 5, 2**32 + 7, 2**40, 2**63 - 1]  # large synthetic ids are valid
    want = token_bytes(ids)
    assert want.dtype == np.dtype("<i8") and want.tolist() == ids
    for same in (
        np.array(ids, dtype=np.uint64),
        np.array(ids, dtype=np.int64),
        torch.tensor(ids),
        tuple(ids),
    ):
        assert token_bytes(same).tolist() == ids
    assert token_bytes(np.arange(5, dtype=np.uint16)).tolist() == list(range(5))
    assert token_bytes(torch.arange(5, dtype=torch.int32)).tolist() == list(range(5))
    assert token_bytes([]).size == 0 and token_bytes(np.array([], dtype=np.float64)).size == 0


@given(st.lists(st.integers(0, 2**63 - 1), max_size=80))
def test_every_valid_int_list_is_accepted_unchanged(ids):
    arr = token_bytes(ids)
    assert arr.tolist() == ids
    assert len(prefix_hashes(ids, 8)) == len(ids) // 8


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        (lambda n: torch.full((n,), NUM_BLOCKS * BLOCK), "out of range"),
        (lambda n: torch.arange(n) + NUM_BLOCKS * BLOCK - 3, "out of range"),
        (lambda n: torch.full((n,), -2), "invalid"),
        (lambda n: torch.arange(n, dtype=torch.float32), "integers"),
        (lambda n: [float(i) for i in range(n)], "integers"),
    ],
)
def test_bad_slot_mappings_are_value_errors_naming_the_problem(engine, slots, match):
    tokens = list(range(2 * CHUNK))
    for call in (engine.store, engine.retrieve):
        with pytest.raises(ValueError, match=match):
            call(tokens, slots(len(tokens)))


def test_minus_one_and_the_last_slot_are_valid(engine):
    tokens = list(range(CHUNK))
    slots = torch.arange(NUM_BLOCKS * BLOCK - CHUNK, NUM_BLOCKS * BLOCK)
    assert engine.store(tokens, slots) == CHUNK
    mask = engine.retrieve(tokens, torch.full((CHUNK,), -1))
    assert not mask.any()


@pytest.mark.parametrize("salt", [123, b"bytes", 1.5, ["a"]])
def test_a_salt_that_is_not_text_is_a_value_error(engine, salt):
    tokens = list(range(CHUNK))
    with pytest.raises(ValueError, match="scope"):
        engine.lookup(tokens, scope=salt)
    with pytest.raises(ValueError, match="scope"):
        engine.store(tokens, torch.arange(CHUNK), scope=salt)

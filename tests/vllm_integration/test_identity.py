"""Request identity: what a chunk key is made of on the vLLM path (``identity.py``), tested with
real vLLM ``Request`` objects against the scheduler half of the connector and real worker parts
(a CacheEngine on the CPU platform, holds, the scheduler's index; ``sched_harness.py``).

Every test here is a wrong-KV hazard of a key that covered only the token ids and the salt:
two images behind the same placeholder tokens, a LoRA adapter, prompt embeddings, an fp8 format
or a weights update would otherwise share chunks.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from sched_harness import Harness, empty_output
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.core import CacheEngine, load_config
from kvtier.core.keys import KeyScope, salt_id
from kvtier.core.layout import PagedLayout
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.vllm_integration.connector import KVTierConnector
from kvtier.vllm_integration.identity import adapter_identity, identity_tokens
from kvtier.vllm_integration.layout import CacheSpec, page_layout

BLOCK, CHUNK = 32, 64
TEXT = list(range(100, 100 + 4 * CHUNK))  # 256 tokens; an "image" at [64, 192)
IMAGE = PlaceholderRange(offset=CHUNK, length=2 * CHUNK)


def feature(identifier: str, pos: PlaceholderRange = IMAGE) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=identifier, mm_position=pos
    )


def request(tokens=TEXT, *, images=(), lora=None, salt=None, embeds=None) -> Request:
    return Request(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=list(tokens) if tokens is not None else None,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        mm_features=[feature(i) for i in images],
        lora_request=lora,
        cache_salt=salt,
        prompt_embeds=embeds,
    )


# -- identity tokens ---------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    offset=st.integers(0, 200),
    length=st.integers(1, 100),
    a=st.text(min_size=1, max_size=12),
    b=st.text(min_size=1, max_size=12),
)
def test_only_placeholder_positions_carry_the_item(offset, length, a, b) -> None:
    pos = PlaceholderRange(offset=offset, length=length)
    tokens = np.arange(300, dtype=np.int64)
    ra = Request(
        "a", tokens.tolist(), SamplingParams(max_tokens=1), None, mm_features=[feature(a, pos)]
    )
    rb = Request(
        "b", tokens.tolist(), SamplingParams(max_tokens=1), None, mm_features=[feature(b, pos)]
    )
    ia, ib = identity_tokens(ra, tokens), identity_tokens(rb, tokens)
    inside = np.zeros(len(tokens), dtype=bool)
    inside[offset : offset + length] = True
    assert np.array_equal(ia[~inside], tokens[~inside])  # text positions untouched
    assert (ia[inside] >= 1 << 62).all()  # never a real token id
    assert np.array_equal(ia, identity_tokens(ra, tokens))  # deterministic
    assert np.array_equal(ia[inside], ib[inside]) == (a == b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300))
def test_a_token_list_converts_exactly_as_numpy_would(ids) -> None:
    out = identity_tokens(request(ids), ids)
    assert out.dtype == np.int64 and out.flags.writeable
    assert np.array_equal(out, np.array(ids, dtype=np.int64))


@pytest.mark.parametrize("bad", [[1, 2.0], [1, 2**63], [1, -(2**63) - 1], [1, "2"]])
def test_a_token_list_that_is_not_64_bit_integers_is_refused(bad) -> None:
    """numpy would truncate 2.0 (or another float) to a real token id silently."""
    with pytest.raises(ValueError, match="64-bit integers"):
        identity_tokens(request(TEXT), bad)


def test_scopes_seed_different_chains_but_salt_ids_follow_the_salt() -> None:
    scopes = [
        KeyScope(),
        KeyScope("s"),
        KeyScope("s", "lora-a"),
        KeyScope("s", "lora-b"),
        KeyScope("s", "lora-a", "g1"),
        KeyScope(None, None, "g1"),
    ]
    assert len({s.seed() for s in scopes}) == len(scopes)
    assert KeyScope.of("s") == KeyScope("s") and KeyScope("", "", "") == KeyScope()
    assert salt_id(KeyScope("s", "lora-a", "g1")) == salt_id("s")
    with pytest.raises(ValueError, match="salt"):
        KeyScope.of(123)  # type: ignore[arg-type]


def test_adapter_identity_follows_the_adapter_files(tmp_path) -> None:
    path = tmp_path / "adapter"
    path.mkdir()
    (path / "adapter_model.safetensors").write_bytes(b"weights-1")
    lora = LoRARequest("a", 1, str(path))
    first = adapter_identity(lora)
    assert first == adapter_identity(LoRARequest("a", 7, str(path)))  # the int id is per engine
    assert first == adapter_identity(LoRARequest("b", 1, str(path)))  # a name is not content
    (path / "adapter_model.safetensors").write_bytes(b"weights-2, rewritten in place")
    assert adapter_identity(lora) != first
    assert adapter_identity(None) is None


def test_an_adapter_rewritten_in_place_with_its_old_size_and_mtime_is_another(
    tmp_path, monkeypatch
) -> None:
    """Its file digest is remembered per file version (inode, size, mtime, ctime): ``cp -p``
    of same-size weights over the old file keeps size and mtime, never the ctime."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "adapter"
    path.mkdir()
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(b"weights-1")
    st = weights.stat()
    lora = LoRARequest("a", 1, str(path))
    first = adapter_identity(lora)
    weights.write_bytes(b"weights-2")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size
    assert adapter_identity(lora) != first


def test_an_engine_restarted_with_another_fp8_format_misses(tmp_path) -> None:
    """fp8_e4m3 and fp8_e5m2 caches are both uint8 tensors: only vLLM's cache dtype string tells
    their bytes apart. Saved under one, a restart under the other must miss, not load them."""
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.randint(
            0, 255, (8, 2, BLOCK, 128), dtype=torch.uint8
        )
        for i in range(2)
    }
    config = load_config(
        env={},
        overrides={
            "chunk_size": CHUNK,
            "tiers": ["local_cpu", "local_disk"],
            "local_cpu_size_gb": 0.01,
            "local_disk_path": str(tmp_path / "disk"),
        },
    )
    tokens = np.arange(2 * CHUNK, dtype=np.int64)

    spec = CacheSpec(BLOCK, 2, 64, 128, use_mla=False, kind="FullAttentionSpec")

    def engine(fmt: str) -> CacheEngine:
        reg = page_layout(
            caches,
            spec,
            paged_layout=PagedLayout.LBHNC,
            num_blocks=8,
            cache_dtype=fmt,
            interior="CPU_ATTN/vec",
        )
        eng = CacheEngine(config, reg.layout, model="m", platform=CPUPlatform())
        eng.register_kv_caches(reg.caches, reg.num_blocks)
        return eng

    first = engine("fp8_e4m3")
    first.store(tokens, torch.arange(len(tokens)))
    assert first.storage.flush(10)
    first.close()
    for fmt, hit in (("fp8_e5m2", 0), ("fp8", 0), ("fp8_e4m3", len(tokens))):
        restarted = engine(fmt)
        assert restarted.lookup(tokens) == hit, fmt
        restarted.close()


def test_requires_piecewise_cudagraphs_only_layerwise(isolated_env) -> None:
    assert KVTierConnector.requires_piecewise_for_cudagraph({"use_layerwise": True})
    assert not KVTierConnector.requires_piecewise_for_cudagraph({})


# -- the scheduler half against real worker parts (sched_harness.py) ---------------------------
@pytest.fixture
def served():
    """A SchedulerSide over a real CacheEngine, its holds and its reports to the scheduler."""
    harness = Harness.create()
    yield harness
    harness.close()


def test_two_images_behind_the_same_placeholders_never_share(served) -> None:
    h = served
    h.store(request(images=["image-1"]))
    assert h.hit(request(images=["image-1"])) == len(TEXT) - BLOCK  # same image: full hit
    # Same text, same placeholder tokens, another image: only the text before the image hits.
    assert h.hit(request(images=["image-2"])) == IMAGE.offset


def adapter_dir(root, name: str, content: bytes) -> str:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_model.safetensors").write_bytes(content)
    (path / "adapter_config.json").write_text('{"r": 8}')
    return str(path)


def test_lora_adapters_and_base_never_share(served, tmp_path) -> None:
    h = served
    a = adapter_dir(tmp_path, "a", b"adapter a")
    b = adapter_dir(tmp_path, "b", b"adapter b")
    h.store(request())
    full = len(TEXT) - BLOCK
    assert h.hit(request()) == full
    assert h.hit(request(lora=LoRARequest("a", 1, a))) == 0
    h.store(request(lora=LoRARequest("a", 1, a)))
    assert h.hit(request(lora=LoRARequest("a", 3, a))) == full
    assert h.hit(request(lora=LoRARequest("b", 2, b))) == 0
    # The same files under another name and path: the same adapter.
    copy = adapter_dir(tmp_path / "elsewhere", "renamed", b"adapter a")
    assert h.hit(request(lora=LoRARequest("renamed", 4, copy))) == full


def test_an_adapter_whose_files_cannot_be_read_is_neither_looked_up_nor_saved(
    served, tmp_path
) -> None:
    """A Hub id not downloaded here (or a path that does not exist) has no content identity:
    keying it by its name would serve another adapter's KV after the name is reused."""
    h = served
    missing = LoRARequest("hub", 1, "no-such-org/no-such-adapter")
    assert adapter_identity(missing).startswith("unresolved:")
    h.store(request(lora=missing))
    assert h.hit(request(lora=missing)) == 0
    assert h.prefill(request(lora=missing)).saves == []


def test_reset_cache_with_changed_weights_serves_nothing_old(served) -> None:
    h = served
    h.store(request(salt="t"))
    assert h.hit(request(salt="t")) == len(TEXT) - BLOCK
    running = request(salt="t")
    h.hit(running)
    h.live = ["weights-1"]  # updated in place, as an RL step does
    assert h.sched.reset_cache() is True
    # "Not yet" until the next step's reports resolve the reset, then a miss.
    assert h.sched.get_num_new_matched_tokens(request(salt="t"), 0) == (None, False)
    assert h.hit(request(salt="t")) == 0
    assert h.sched.weights.current is not None
    # A request that started before the reset mixes weights: it is neither served nor saved.
    assert h.hit(running) == 0
    assert h.prefill(running).saves == []
    h.store(request(salt="t"))
    assert h.hit(request(salt="t")) == len(TEXT) - BLOCK  # the new generation's own


def test_reset_cache_with_unchanged_weights_keeps_the_cache(served) -> None:
    h = served
    h.store(request(salt="t"))
    assert h.sched.reset_cache() is True
    assert h.hit(request(salt="t")) == len(TEXT) - BLOCK  # once the workers answered
    assert h.sched.weights.current is None


def test_a_reset_before_the_first_report_with_unchanged_weights_keeps_the_cache() -> None:
    """A reset right after start (before any step reported): each worker compares with its own
    start, so unchanged weights still keep the generation (the cache stays shared)."""
    h = Harness.create(report_first=False)
    try:
        h.sched.reset_cache()
        h.step()
        assert not h.sched.weights.pending
        assert h.sched.weights.current is None
    finally:
        h.close()


def test_instances_that_made_the_same_change_agree_on_the_generation() -> None:
    """Two engines that updated to the same weights share keys after their resets; one with
    other weights does not; none uses a random number."""
    generations = []
    for live in (["w-1", "w-1"], ["w-1", "w-1"], ["w-1", "w-2"]):
        h = Harness.create(world_size=2)
        try:
            h.live = live
            h.sched.reset_cache()
            h.step()
            assert not h.sched.weights.pending
            generations.append(h.sched.weights.current)
        finally:
            h.close()
    assert generations[0] == generations[1] is not None
    assert generations[2] != generations[0]


def test_a_reset_is_pending_until_every_rank_answered() -> None:
    h = Harness.create(world_size=2)
    try:
        h.store(request())
        h.sched.reset_cache()
        meta = h.sched.build_connector_meta(empty_output())
        h.weights_epoch = meta.weights_epoch
        h.ranks[0].feed.weights(meta.weights_epoch, "w-1", True)  # rank 1 has not answered
        h.report()
        assert h.sched.weights.pending
        assert h.sched.get_num_new_matched_tokens(request(), 0) == (None, False)
        h.ranks[1].feed.weights(meta.weights_epoch, "weights-0", False)
        h.report()
        assert not h.sched.weights.pending
        assert h.sched.weights.current is not None  # rank 0's weights changed
    finally:
        h.close()


def test_prompt_embeddings_are_neither_looked_up_nor_saved(served) -> None:
    h = served
    zeros = [0] * len(TEXT)
    h.store(request(zeros))  # a token prompt of zeros, which embeddings' placeholders look like
    embeds = request(zeros, embeds=torch.zeros(len(TEXT), 16))
    assert h.hit(embeds) == 0
    assert h.prefill(embeds).saves == []


def test_blocks_of_finished_requests_are_pending_until_their_saves_are_reported(served) -> None:
    """vLLM waits for blocks a connector will free (instead of preempting) while
    ``has_pending_block_frees``; that stays true exactly until the workers report the save."""
    h = served
    sched = h.sched
    req = request(salt="frees")
    assert h.prefill(req).saves
    assert not sched.has_pending_block_frees()
    assert sched.request_finished(req) is True  # keep the blocks: a save is in flight
    assert sched.has_pending_block_frees()
    sched.update_connector_output(KVConnectorOutput(finished_sending={"another-request"}))
    assert sched.has_pending_block_frees()
    sched.update_connector_output(KVConnectorOutput(finished_sending={req.request_id}))
    assert not sched.has_pending_block_frees()


@pytest.mark.parametrize("field", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_by_name(field) -> None:
    """Each rank would store its token shard under one key: refused, not served wrong."""
    from types import SimpleNamespace

    from kvtier.core.errors import ConfigError
    from kvtier.vllm_integration.identity import refuse_context_parallel

    refuse_context_parallel(SimpleNamespace(**{field: 1}))
    with pytest.raises(ConfigError, match=field):
        refuse_context_parallel(SimpleNamespace(**{field: 2}))


def test_a_reset_the_workers_never_answer_stops_waiting_and_saves_nothing(served) -> None:
    """No hang: past ``lookup_timeout_s`` requests are computed, and nothing is saved under a
    generation nobody confirmed."""
    h = served
    now = [100.0]
    h.sched.weights._clock = lambda: now[0]
    h.sched.reset_cache()
    assert h.sched.get_num_new_matched_tokens(request(), 0) == (None, False)
    now[0] += h.sched.config.lookup_timeout_s + 1
    req = request()
    assert h.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert h.prefill(req).saves == []

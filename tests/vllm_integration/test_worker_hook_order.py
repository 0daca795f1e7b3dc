"""The worker half's hooks called in the order of each vLLM model runner, on real kvtier parts
over CPU tensors (``WorkerSide.start``: the runtime ``register_kv_caches`` builds once it has
read vLLM's views and weights, which need a model runner).

- V1 (vLLM 0.32's runners): ``start_load_kv``, per layer ``wait_for_layer_load`` and
  ``save_kv_layer``, ``wait_for_save``, then ``get_finished``, ``get_block_ids_with_load_errors``
  and ``build_connector_worker_meta``.
- Model Runner V2 with a deferred step end (vLLM 0.33's GPU runner under speculative decoding,
  ``post_forward(defer_finalize=True)`` in ``vllm/v1/worker/gpu/kv_connector.py``): the three
  questions come *before* ``wait_for_save``, which ``finalize_step`` calls after the drafter.

Either way a load that comes up short reports its missing blocks in the step that ran it (vLLM
then recomputes or fails exactly those), and the step's saves land; in MRV2's order a save is
reported copied one step later (its blocks are held one step longer), never lost.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
from kvtier.core.keys import KeyScope
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.vllm_integration.messages import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.vllm_integration.worker.side import WorkerSide

BLOCK, CHUNK, BLOCKS = 16, 32, 32
LAYOUT = KVLayout(3, 2, 16, "bfloat16", BLOCK)
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.num_layers)]
PROMPT = np.arange(1000, 1000 + 3 * CHUNK + 5)


def worker(layerwise: bool) -> WorkerSide:
    config = load_config(
        env={},
        overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"], "use_layerwise": layerwise},
    )
    storage = HostMemoryStorageManager(HostArena.create(8 << 20))
    engine = CacheEngine(config, LAYOUT, model="m", platform=CPUPlatform(), storage=storage)
    g = torch.Generator().manual_seed(0)
    caches = [
        torch.randn(LAYOUT.expected_cache_shape(BLOCKS), generator=g).to(torch.bfloat16)
        for _ in LAYERS
    ]
    engine.register_kv_caches(caches)
    side = WorkerSide(
        config,
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        block_size=BLOCK,
        engine_id="hook-order",
    )
    side.start(engine, {name: i for i, name in enumerate(LAYERS)}, rank=0, tier_events=False)
    # The prompt's first chunk is stored (from blocks 0-1), its second is not.
    engine.store(PROMPT[:CHUNK], torch.arange(CHUNK))
    return side


def step(side: WorkerSide, meta: KVTierMetadata, order: str) -> tuple[set[int], object]:
    """One step's hooks in ``order``; the failed blocks and the worker's report."""
    side.start_load_kv(meta)
    for name in LAYERS:
        side.wait_for_layer_load(name)
        side.save_kv_layer(name, meta)
    if order == "v1":
        side.wait_for_save(meta)
    side.get_finished(set())
    failed = side.get_block_ids_with_load_errors()
    report = side.build_connector_worker_meta()
    if order == "mrv2":
        side.wait_for_save(meta)  # finalize_step, after the drafter
    return failed, report


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("order", ["v1", "mrv2"])
def test_a_short_load_is_reported_in_its_own_step_in_either_order(
    order, layerwise, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("KVTIER_RUNTIME_DIR", str(tmp_path))  # the worker's control socket
    side = worker(layerwise)
    try:
        scope = KeyScope()
        # Two chunks answered by the index (no hold) into blocks 10-13: only the first is there.
        load = LoadSpec("r-load", PROMPT, [10, 11, 12, 13], 0, 2 * CHUNK, scope)
        save = SaveSpec("r-save", PROMPT[: 3 * CHUNK], list(range(20, 26)), CHUNK, scope)
        failed, _ = step(side, KVTierMetadata(loads=[load], saves=[save], step=1), order)
        assert failed == {12, 13}, "the second chunk's blocks, in the step that loaded"
        assert side.counters.snapshot()["loaded_tokens"] == CHUNK
        following, _ = step(side, KVTierMetadata(step=2), order)
        assert following == set(), "reported once"
        rt = side._rt
        assert rt is not None and rt.saves.saver.drain(30)
        # The save landed: chunks 1 and 2 of the prompt (from blocks 22-25) are stored now.
        assert rt.engine.lookup(PROMPT) == 3 * CHUNK
    finally:
        side.shutdown()


def test_a_save_in_the_step_of_a_short_load_is_not_made_and_its_request_still_finishes(
    tmp_path, monkeypatch
) -> None:
    """An index answer loaded before the forward pass finds its second chunk gone; the same
    step's save of that request would store the blocks the load did not fill. It is not made
    (the scheduler saves the prompt after vLLM's recompute), and the request is still reported
    done when it finishes, so vLLM gets its blocks back."""
    monkeypatch.setenv("KVTIER_RUNTIME_DIR", str(tmp_path))  # the worker's control socket
    side = worker(False)
    try:
        scope = KeyScope()
        blocks = list(range(10, 16))
        load = LoadSpec("r", PROMPT, blocks[:4], 0, 2 * CHUNK, scope)
        save = SaveSpec("r", PROMPT[: 3 * CHUNK], blocks, CHUNK, scope)
        failed, _ = step(side, KVTierMetadata(loads=[load], saves=[save], step=1), "v1")
        assert failed == {12, 13}
        assert side.counters.snapshot()["saves_dropped"] == 1
        rt = side._rt
        assert rt is not None and rt.saves.saver.drain(30)
        assert rt.engine.lookup(PROMPT) == CHUNK  # nothing stored from the unfilled blocks
        sending, _ = side.get_finished({"r"})
        assert sending == {"r"}
    finally:
        side.shutdown()

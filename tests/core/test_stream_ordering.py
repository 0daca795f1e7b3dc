"""A save handed to another thread waits for the device work that wrote the KV (real GPU only).

vLLM runs the model on a non-default stream of its main thread and kvtier saves on its saver
thread, whose current stream does not wait for that one. The save carries a marker recorded on
the compute stream (``Platform.record_marker``); ``CacheEngine.store(..., ready=marker)`` orders
the copy after it. ``benchmarks/ordering_gpu.py`` runs the same rounds without the marker too
(most of them store stale bytes) and records the run.
"""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch

from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
from kvtier.core.platform import get_platform

pytestmark = pytest.mark.cuda

BLOCK, CHUNK, LAYERS = 16, 256, 4


@pytest.fixture
def cuda_engine():
    if os.environ.get("KVTIER_TEST_DEVICE") != "cuda" or not torch.cuda.is_available():
        pytest.skip("stream ordering needs a real NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)")
    platform = get_platform("cuda", device_index=0)
    layout = KVLayout(LAYERS, 8, 128, "bfloat16", BLOCK, "LBHNC")
    config = load_config(env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"]})
    arena = HostArena.create(16 * math.prod(layout.chunk_shape(CHUNK)) * 2, pin_memory=True)
    engine = CacheEngine(
        config, layout, model="ordering", platform=platform, storage=HostMemoryStorageManager(arena)
    )
    caches = [
        torch.zeros(
            layout.expected_cache_shape(CHUNK // BLOCK), dtype=torch.bfloat16, device="cuda"
        )
        for _ in range(LAYERS)
    ]
    engine.register_kv_caches(caches)
    yield engine, platform, caches
    engine.close()


def test_a_save_on_another_thread_stores_the_final_kv(cuda_engine) -> None:
    engine, platform, caches = cuda_engine
    compute = torch.cuda.Stream()
    for r in range(1, 9):
        tokens = torch.full((CHUNK,), r, dtype=torch.int64)
        with torch.cuda.stream(compute):
            torch.cuda._sleep(50_000_000)  # the forward pass is still running...
            for cache in caches:
                cache.fill_(float(r))  # ...when it writes this round's KV
            marker = platform.record_marker()
        saver = threading.Thread(
            target=engine.store, args=(tokens, torch.arange(CHUNK)), kwargs={"ready": marker}
        )
        saver.start()
        saver.join()
        obj = engine.storage.get(engine.store_spans(tokens)[0].key)
        assert obj is not None
        with obj:
            assert bool((obj.tensor == float(r)).all()), f"round {r} stored stale KV"


def test_markers_are_none_on_the_cpu() -> None:
    platform = get_platform("cpu")
    marker = platform.record_marker()
    assert marker is None
    platform.wait_marker(marker)  # a no-op, not an error

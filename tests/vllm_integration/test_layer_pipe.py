"""Synchronous loads on the layer pipe (``worker/layer_pipe.py``): copied on another thread
while the forward pass runs, each attention layer waiting for its own layer. Real kvtier parts
over CPU tensors, the hooks in vLLM 0.32's order (``test_worker_hook_order.step``); the worker
is given CPUs outside its binding as vLLM CPU's default binding leaves it.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from test_worker_hook_order import CHUNK, LAYERS, PROMPT, worker

from kvtier.core import affinity
from kvtier.core.keys import KeyScope
from kvtier.vllm_integration.messages import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.vllm_integration.worker.side import WorkerSide

STORED = [0, 1]  # the blocks the prompt's first chunk was stored from (``worker``)
TARGET = [10, 11]  # the blocks its load fills


@pytest.fixture
def piped(tmp_path, monkeypatch):
    """A worker whose synchronous loads go to the layer pipe; each layer's copy is slowed down
    (as under a busy memory bus) and the threads that copied are recorded."""
    monkeypatch.setenv("KVTIER_RUNTIME_DIR", str(tmp_path))  # the worker's control socket
    monkeypatch.setattr(affinity, "_cpus", frozenset(os.sched_getaffinity(0)))
    side = worker(False)
    rt = side._rt
    assert rt is not None and rt.engine.mover is not None
    mover = rt.engine.mover
    copied_on: list[int] = []
    load_layer = mover._load_layer

    def slow(layer, picked):
        time.sleep(0.05)
        copied_on.append(threading.get_ident())
        load_layer(layer, picked)

    monkeypatch.setattr(mover, "_load_layer", slow)
    yield side, copied_on
    side.shutdown()


def caches(side: WorkerSide) -> list[torch.Tensor]:
    rt = side._rt
    assert rt is not None and rt.engine.mover is not None
    return rt.engine.mover.kv_caches


def test_each_layer_is_in_place_when_its_wait_returns(piped) -> None:
    """The forward pass reads layer i right after ``wait_for_layer_load`` of layer i returns: its
    pages are the stored ones then, though the copy is slower than the layers before it."""
    side, copied_on = piped
    load = LoadSpec("r", PROMPT, TARGET, 0, CHUNK, KeyScope())
    meta = KVTierMetadata(loads=[load], step=1)
    side.start_load_kv(meta)
    for i, name in enumerate(LAYERS):
        side.wait_for_layer_load(name)
        cache = caches(side)[i]
        assert torch.equal(cache[TARGET], cache[STORED]), f"layer {i} read before its copy"
    side.wait_for_save(meta)
    side.get_finished(set())
    assert side.get_block_ids_with_load_errors() == set()
    assert len(copied_on) == len(LAYERS)
    assert threading.get_ident() not in copied_on, "copied on the forward pass's thread"
    assert side.counters.snapshot()["loaded_tokens"] == CHUNK
    assert side.counters.snapshot()["layer_pipe_loads"] == 1


def test_a_copy_that_raises_fails_its_load_in_its_step_and_drops_its_save(
    piped, monkeypatch
) -> None:
    """A layer copy raising on the pipe: the load's blocks are reported failed in the step that
    loaded (vLLM recomputes them), the step's save of the request is not made, the next step's
    load copies again."""
    side, _ = piped
    rt = side._rt
    assert rt is not None and rt.engine.mover is not None
    slow = rt.engine.mover._load_layer

    def broken(layer, picked):
        if layer == 1:
            raise RuntimeError("copy failed")
        slow(layer, picked)

    monkeypatch.setattr(rt.engine.mover, "_load_layer", broken)
    scope = KeyScope()
    blocks = [10, 11, 12, 13]
    load = LoadSpec("r", PROMPT, blocks[:2], 0, CHUNK, scope)
    save = SaveSpec("r", PROMPT[: 2 * CHUNK], blocks, CHUNK, scope)
    meta = KVTierMetadata(loads=[load], saves=[save], step=1)
    side.start_load_kv(meta)
    for name in LAYERS:
        side.wait_for_layer_load(name)
    side.wait_for_save(meta)
    side.get_finished(set())
    assert side.get_block_ids_with_load_errors() == {10, 11}
    assert side.counters.snapshot()["saves_dropped"] == 1
    assert rt.saves.saver.drain(30)
    assert rt.engine.lookup(PROMPT) == CHUNK, "nothing stored from the unfilled blocks"

    monkeypatch.setattr(rt.engine.mover, "_load_layer", slow)
    again = KVTierMetadata(loads=[LoadSpec("r2", PROMPT, blocks[2:], 0, CHUNK, scope)], step=2)
    side.start_load_kv(again)
    for name in LAYERS:
        side.wait_for_layer_load(name)
    side.wait_for_save(again)
    assert side.get_block_ids_with_load_errors() == set()
    for cache in caches(side):
        assert torch.equal(cache[blocks[2:]], cache[STORED])


def test_a_step_waits_for_its_loads_even_where_no_layer_asked(piped) -> None:
    """A step whose forward pass asked for no layer (vLLM skips the wait without attention
    metadata) still has every load in place before its saves are made (``wait_for_save``)."""
    side, _ = piped
    load = LoadSpec("r", PROMPT, TARGET, 0, CHUNK, KeyScope())
    meta = KVTierMetadata(loads=[load], step=1)
    side.start_load_kv(meta)
    side.wait_for_save(meta)
    for cache in caches(side):
        assert torch.equal(cache[TARGET], cache[STORED])

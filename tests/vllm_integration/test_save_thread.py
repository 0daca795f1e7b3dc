"""The worker's saver thread (``saver.Saver``) over a real CacheEngine on the CPU platform.

The hazard it guards: vLLM reuses a preempted request's blocks once the worker's drain returns.
A save still copying then would read the new owner's KV and commit it under the old prompt's
keys; a drain that times out must abandon it.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
from kvtier.core.keys import KeyScope
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.vllm_integration.messages import SaveSpec
from kvtier.vllm_integration.worker.save_thread import Saver

BLOCK, CHUNK = 16, 64
PROMPT = np.arange(1000, 1000 + 2 * CHUNK, dtype=np.int64)


@pytest.fixture
def engine():
    layout = KVLayout(2, 2, 8, "bfloat16", BLOCK, "LBHNC")
    config = load_config(env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"]})
    arena = HostArena.create(8 * math.prod(layout.chunk_shape(CHUNK)) * 2)
    eng = CacheEngine(
        config, layout, model="m", platform=CPUPlatform(), storage=HostMemoryStorageManager(arena)
    )
    eng.register_kv_caches(
        [torch.randn(layout.expected_cache_shape(16)).to(torch.bfloat16) for _ in range(2)]
    )
    yield eng
    eng.close()


def spec(req_id: str = "r1", tokens: np.ndarray = PROMPT) -> SaveSpec:
    return SaveSpec(req_id, tokens, list(range(len(tokens) // BLOCK)), 0, KeyScope())


class Recorder:
    """``on_done`` for the saver: counts, and lets a test wait for N saves."""

    def __init__(self) -> None:
        self.done: list[tuple[int, bool]] = []
        self.cv = threading.Condition()

    def __call__(self, tokens: int, failed: bool) -> None:
        with self.cv:
            self.done.append((tokens, failed))
            self.cv.notify_all()

    def wait(self, n: int) -> list[tuple[int, bool]]:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.done) >= n, timeout=10)
            return list(self.done)


def store_with(
    engine: CacheEngine, copied: threading.Event | None = None, go: threading.Event | None = None
):
    """The worker's store; optionally it stalls between its device copy and its commit, as a
    slow copy would."""
    if copied is not None and go is not None:
        inner = engine.mover
        assert inner is not None
        original = inner.store

        def slow_store(transfers):
            original(transfers)
            copied.set()
            assert go.wait(10)

        inner.store = slow_store  # type: ignore[method-assign]

    def store(s: SaveSpec, ready, keep) -> int:
        slots = torch.arange(len(s.tokens))
        return engine.store(s.tokens, slots, scope=s.scope, ready=ready, keep=keep)

    return store


def test_saves_land_and_requests_stay_pending_until_then(engine) -> None:
    done = Recorder()
    saver = Saver(store_with(engine), done)
    saver.submit([spec("r1"), spec("r2", PROMPT + 5000)], None)
    assert done.wait(2) == [(len(PROMPT), False), (len(PROMPT), False)]
    assert saver.drain(5) is True
    assert saver.pending({"r1", "r2"}) == set()
    assert engine.lookup(PROMPT) == len(PROMPT)
    saver.close(5)


def test_a_drain_that_times_out_abandons_the_save_in_flight(engine) -> None:
    copied, go = threading.Event(), threading.Event()
    done = Recorder()
    saver = Saver(store_with(engine, copied, go), done)
    saver.submit([spec()], None)
    assert copied.wait(10)  # the copy has read the blocks...
    assert saver.pending({"r1"}) == {"r1"}
    assert saver.drain(0.05) is False  # ...vLLM gives up waiting and reuses them
    go.set()
    assert done.wait(1) == [(0, False)]
    assert engine.lookup(PROMPT) == 0  # nothing committed from blocks that were reused
    assert engine.stats.store_abandoned_chunks == 2
    assert saver.pending({"r1"}) == set()
    saver.close(5)


def test_wait_idle_waits_for_the_saves_and_abandons_nothing(engine) -> None:
    """An engine step with nothing scheduled waits for kvtier's saves (``WorkerSide``), never
    longer than asked, and unlike ``drain`` a save still running at the bound lands."""
    copied, go = threading.Event(), threading.Event()
    done = Recorder()
    saver = Saver(store_with(engine, copied, go), done)
    assert saver.wait_idle(0.0)  # nothing queued
    saver.submit([spec()], None)
    assert copied.wait(10)
    assert saver.wait_idle(0.05) is False
    threading.Timer(0.05, go.set).start()
    assert saver.wait_idle(10) is True
    assert done.wait(1) == [(len(PROMPT), False)]
    assert engine.lookup(PROMPT) == len(PROMPT)
    saver.close(5)


def test_a_failed_save_is_counted_not_raised(engine) -> None:
    def broken(s, ready, keep) -> int:
        raise RuntimeError("disk on fire")

    done = Recorder()
    saver = Saver(broken, done)
    saver.submit([spec()], None)
    assert done.wait(1) == [(0, True)]
    assert saver.drain(5) is True
    saver.close(5)


def test_the_saver_reports_a_step_copied_only_when_it_and_every_earlier_step_are(engine) -> None:
    copied, go = threading.Event(), threading.Event()
    done = Recorder()
    saver = Saver(store_with(engine, copied, go), done)
    try:
        assert saver.copied_through == -1
        saver.mark(1)  # a step without saves
        assert saver.copied_through == 1
        saver.submit([spec("r1")], None, 2)  # stalls after its device copy
        saver.mark(3)
        saver.submit([spec("r2", PROMPT + 7000)], None, 4)
        assert copied.wait(10)
        assert saver.copied_through == 1  # step 2's save is still running
        go.set()
        done.wait(2)
        assert saver.drain(10)
        assert saver.copied_through == 4
    finally:
        go.set()
        saver.close(10)


def test_a_failed_save_still_counts_as_done_reading_the_blocks() -> None:
    def broken(s, ready, keep) -> int:
        raise RuntimeError("tier down")

    done = Recorder()
    saver = Saver(broken, done)
    try:
        saver.submit([spec("r1")], None, 5)
        assert done.wait(1) == [(0, True)]
        assert saver.copied_through == 5
    finally:
        saver.close(10)

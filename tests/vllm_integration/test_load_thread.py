"""The worker's loader thread (``loader.Loader``): every asynchronous load reported exactly once,
and a fast load reported by the step that submitted it.

vLLM starts a step's asynchronous loads after the forward pass and asks for finished ones right
after. A load not done by then is reported a step later and its request waits that step; so
``take_finished`` waits a moment for the loads submitted since its last call, never for older
ones still running (a slow disk or Redis load must not stall every later step).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from kvtier.core.keys import KeyScope
from kvtier.vllm_integration.messages import LoadSpec
from kvtier.vllm_integration.worker.load_thread import Loader


def spec(rid: str) -> LoadSpec:
    return LoadSpec(rid, np.arange(64), [0, 1], 0, 64, KeyScope(), None, True)


def wait_idle(loader: Loader) -> None:
    for _ in range(1000):
        if not loader.in_flight:
            return
        time.sleep(0.01)
    raise AssertionError("the loader never finished")


def test_a_load_submitted_this_step_is_reported_by_this_step() -> None:
    def load(s, hold, marker) -> set[int]:
        time.sleep(0.05)  # a load that is not done when vLLM asks right after submitting it
        return set()

    loader = Loader(load, lambda s: set(s.block_ids))
    try:
        loader.submit(spec("a"), None, None)
        assert loader.take_finished(wait_s=10) == ({"a"}, set())
        loader.submit(spec("b"), None, None)
        assert loader.take_finished() == (set(), set())  # no wait: reported by the next call
        wait_idle(loader)
        assert loader.take_finished() == ({"b"}, set())
    finally:
        loader.close(10)


def test_an_older_slow_load_is_not_waited_for_and_still_reported_once() -> None:
    go = threading.Event()
    entered = threading.Event()

    def load(s, hold, marker) -> set[int]:
        if s.req_id == "slow":
            entered.set()
            assert go.wait(10)
            raise OSError("tier went away")  # a failed load: every block is recomputed
        return set()

    loader = Loader(load, lambda s: set(s.block_ids))
    try:
        loader.submit(spec("slow"), None, None)
        assert entered.wait(10)
        assert loader.take_finished(wait_s=0.05) == (set(), set())  # waited, bounded, not done
        # The next step: "slow" is older than the last call, so nothing is waited for.
        done = threading.Event()
        result: list = []

        def take() -> None:
            result.append(loader.take_finished(wait_s=60))
            done.set()

        threading.Thread(target=take, daemon=True).start()
        assert done.wait(30), "take_finished waited for a load submitted before its last call"
        assert result == [(set(), set())]
        go.set()
        wait_idle(loader)
        assert loader.take_finished() == ({"slow"}, {0, 1})
        assert loader.take_finished() == (set(), set())
    finally:
        go.set()
        loader.close(10)


def test_wait_idle_waits_for_every_load_in_flight_and_no_longer_than_asked() -> None:
    """An engine step with nothing scheduled waits for kvtier's loads (``WorkerSide``): the
    wait ends when the last one does, or at its bound while one is still running."""
    go = threading.Event()

    def load(s, hold, marker) -> set[int]:
        go.wait(10)
        return set()

    loader = Loader(load, lambda s: set(s.block_ids))
    try:
        assert loader.wait_idle(0.0)  # nothing in flight
        loader.submit(spec("a"), None, None)
        assert not loader.wait_idle(0.05)  # still running: the bound ends the wait
        threading.Timer(0.05, go.set).start()
        assert loader.wait_idle(10)
        assert loader.take_finished() == ({"a"}, set())  # reported once, by the next call
    finally:
        go.set()
        loader.close(10)

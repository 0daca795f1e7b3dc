"""``ThreadCPU``: the CPU time of this process's ``kvtier-*`` threads (metric
``background_cpu_seconds``), read from ``/proc``."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from kvtier.core.engine.thread_cpu import ThreadCPU

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _spin(seconds: float) -> None:
    """Burn about ``seconds`` of CPU on this thread."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


def _run(name: str, seconds: float, stop: threading.Event | None = None) -> threading.Event:
    """A thread named ``name`` that spins ``seconds`` of CPU, then waits for ``stop``; the
    event returned is set once it has spun."""
    spun = threading.Event()

    def body() -> None:
        _spin(seconds)
        spun.set()
        if stop is not None:
            stop.wait(30)

    threading.Thread(target=body, name=name, daemon=True).start()
    return spun


def test_counts_kvtier_threads_only_and_keeps_ended_ones() -> None:
    cpu = ThreadCPU(min_interval_s=0.0)
    base = cpu.seconds()
    stop = threading.Event()
    try:
        spun = [_run("not-kvtier", 0.3, stop), _run("kvtier-test-spin", 0.3, stop)]
        assert all(e.wait(30) for e in spun)
        live = cpu.seconds() - base
        # Our thread's 0.3 s is counted; the other thread's is not (it would add another 0.3).
        assert 0.29 <= live < 0.5, live
    finally:
        stop.set()
    deadline = time.monotonic() + 30
    while any(t.name == "kvtier-test-spin" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # An ended thread keeps its last reading: the sum never goes down.
    assert cpu.seconds() - base >= live


def test_reads_at_most_once_per_interval() -> None:
    cpu = ThreadCPU(min_interval_s=3600.0)
    first = cpu.seconds()
    assert _run("kvtier-test-spin-2", 0.1).wait(30)
    assert cpu.seconds() == first  # within the interval: the last sum, /proc not read

"""kvtier's background writers leave the cores an OpenMP binding gave the thread that started
them (``kvtier.core.affinity``): vLLM's CPU worker is bound to its forward pass's cores, and every
thread it starts inherits that; the lower tiers' writers and their checksum helpers, which nothing
waits on, must not take their CPU from the forward pass. The threads a request or a step waits
on keep the binding.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.core import affinity

CPUS = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="needs a process allowed on 2 CPUs or more")
ONE = frozenset({min(CPUS)})


def _in_bound_thread(fn: Callable[[], object]) -> object:
    """``fn()`` on a new thread bound to one CPU (as vLLM's worker thread is), its result."""
    out: list[object] = []

    def run() -> None:
        os.sched_setaffinity(0, ONE)
        out.append(fn())

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    return out[0]


@pytest.fixture
def background():
    affinity.set_background_cpus(CPUS)
    yield
    affinity.set_background_cpus(None)


def _affinity_of_new_thread(target_wrapper: Callable[..., Callable[..., None]] | None) -> set:
    seen: list[set] = []

    def probe() -> None:
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=target_wrapper(probe) if target_wrapper else probe)
    t.start()
    t.join(30)
    return seen[0]


def test_a_thread_inherits_the_binding_and_a_kvtier_thread_leaves_it(background) -> None:
    plain, kvtier_thread = _in_bound_thread(
        lambda: (_affinity_of_new_thread(None), _affinity_of_new_thread(affinity.background))
    )
    assert plain == ONE, "what every thread a bound worker starts gets"
    assert kvtier_thread == CPUS


def test_without_a_background_set_threads_keep_what_they_inherit() -> None:
    assert affinity.background_cpus() is None
    got = _in_bound_thread(lambda: _affinity_of_new_thread(affinity.background))
    assert got == ONE


def test_a_cache_engines_writers_leave_the_binding_and_its_readers_keep_it(
    background, tmp_path: Path
) -> None:
    """A CacheEngine built and used on a bound thread (as the worker does): its tier writers and
    checksum helpers run on the background CPUs; its readers (a lookup waits on them) keep the
    binding."""
    import torch

    from kvtier.core import CacheEngine, KVLayout, load_config

    before = {t.ident for t in threading.enumerate()}  # other tests' threads are not this one's

    def work() -> dict[str, set]:
        layout = KVLayout(2, 2, 16, "bfloat16", 16)
        config = load_config(
            env={},
            overrides={
                "chunk_size": 32,
                "tiers": ["local_cpu", "local_disk"],
                "local_cpu_size_gb": 0.01,
                "local_disk_path": str(tmp_path),
            },
        )
        engine = CacheEngine(config, layout, model="m")
        caches = [torch.randn(layout.expected_cache_shape(8)).to(torch.bfloat16) for _ in range(2)]
        engine.register_kv_caches(caches)
        tokens = torch.arange(3, 3 + 96)
        engine.store(tokens, torch.arange(96))
        engine.storage.flush(10)
        engine.storage.drop_host()  # the next lookup reads the disk tier
        engine.retrieve(tokens, torch.arange(96))
        threads = {
            t.name: os.sched_getaffinity(t.native_id)
            for t in threading.enumerate()
            if t.name.startswith("kvtier-") and t.native_id is not None and t.ident not in before
        }
        engine.close()
        return threads

    threads = _in_bound_thread(work)
    moved = {n: c for n, c in threads.items() if n.startswith(("kvtier-writer", "kvtier-crc"))}
    assert any(n.startswith("kvtier-writer") for n in moved), threads
    assert all(cpus == CPUS for cpus in moved.values()), threads
    assert all(cpus == ONE for n, cpus in threads.items() if n not in moved), threads


def test_an_openmp_binding_leaves_the_parents_other_cpus() -> None:
    """``unbound_cpus``: with an OpenMP binding in the environment and the process narrowed,
    the parent's CPUs outside the binding (vLLM's engine process starts its workers); nothing
    without a binding."""
    code = (
        "import os; from kvtier.core.affinity import unbound_cpus; "
        f"os.sched_setaffinity(0, {set(ONE)!r}); c = unbound_cpus(); "
        "print(sorted(c) if c is not None else None)"
    )
    env = {k: v for k, v in os.environ.items() if k not in affinity.OMP_BINDING}
    bound = {"GOMP_CPU_AFFINITY": str(min(CPUS))}
    for extra, want in ((bound, sorted(CPUS - ONE)), ({}, None)):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert out.stdout.strip() == str(want), out.stderr

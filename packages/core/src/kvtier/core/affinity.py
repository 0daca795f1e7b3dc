"""Which CPUs kvtier's background writers run on.

A thread starts with the CPU affinity of the thread that starts it. vLLM's CPU backend binds each
worker process to the cores of its OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``, by default one
core per rank, the rest reserved for the front end and the engine loop) through the OpenMP
runtime's environment (``GOMP_CPU_AFFINITY``, ``OMP_PLACES``, ``KMP_AFFINITY``), which binds the
worker's main thread when torch loads. Every thread kvtier starts in that worker would then run
on the forward pass's cores only.

For the threads a step waits on (the saver, the loader, probes) that is where they belong: the
step waits for them, and on the bound core they run exactly then (moving them all measured
slower, docs/serving.md). The lower tiers' writers and their checksum helpers are waited on by
nothing: their work (a disk write with its checksum and fsync of every saved chunk) only takes
CPU from the forward pass there. So the worker tells kvtier which CPUs such threads may use
(``set_background_cpus``; the vLLM connector passes ``unbound_cpus()``, the process's CPUs
outside the binding), and those threads call ``enter_background()`` first. So does the vLLM
connector's layer pipe, which a step does wait on, but whose copies only overlap the forward
pass if they run on another core (``kvtier.vllm_integration.worker.layer_pipe``). Where no set was
given (kvtier used outside such a worker, a GPU worker, a process nothing bound) threads keep
the affinity they inherit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

# The OpenMP runtimes' variables that bind a process's threads to CPUs (GNU, the standard, Intel).
OMP_BINDING = ("GOMP_CPU_AFFINITY", "OMP_PLACES", "KMP_AFFINITY")

_cpus: frozenset[int] | None = None


def set_background_cpus(cpus: Iterable[int] | None) -> None:
    """The CPUs kvtier's background threads started from now on run on (None: the ones they
    inherit)."""
    global _cpus
    _cpus = frozenset(cpus) if cpus is not None else None


def background_cpus() -> frozenset[int] | None:
    """The set ``set_background_cpus`` gave, or None."""
    return _cpus


def enter_background() -> None:
    """Called first by each background thread: take the background CPUs, if any were given. A
    set the kernel refuses (a cpuset that changed since) leaves the thread as it is."""
    cpus = _cpus
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return
    try:
        if os.sched_getaffinity(0) != cpus:
            os.sched_setaffinity(0, cpus)
    except OSError:
        pass


def unbound_cpus() -> frozenset[int] | None:
    """If an OpenMP binding (``OMP_BINDING`` in the environment) narrowed the calling thread to
    fewer CPUs than the process was started with (the parent process's set, which the binding
    did not touch: vLLM's engine process starts its workers): the CPUs of that set outside the
    binding (where vLLM reserves a core for its front end; with a rank per core, the other
    ranks'). None otherwise.

    Outside the binding rather than anywhere in the set: a thread the bound thread wakes tends to
    run on the waker's CPU, and there it takes its time from the forward pass again."""
    if not any(os.environ.get(k) for k in OMP_BINDING) or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        parent = frozenset(os.sched_getaffinity(os.getppid()))
        mine = frozenset(os.sched_getaffinity(0))
    except OSError:
        return None
    if not parent > mine:
        return None
    return parent - mine


def background(target: Callable[..., object]) -> Callable[..., None]:
    """``target`` run after ``enter_background()``: what a background thread is started with (a
    thread pool takes ``initializer=enter_background``)."""

    def run(*args: object, **kwargs: object) -> None:
        enter_background()
        target(*args, **kwargs)

    return run

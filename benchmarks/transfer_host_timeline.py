"""The host side of one transfer call, stage by stage, without the profiler (CUDA machine).

``python benchmarks/transfer_host_timeline.py [--shape small] [--chunks 16]`` wraps the
connector's stages and driver calls with timestamps, runs ``store``, ``load`` and
``store_and_load_async`` many times after warm-up, and prints for the median call every stage
as ``start +duration`` in microseconds from the call's start. Wrapping costs well under a
microsecond a stage; the uninstrumented wall time of the same call is printed beside it.

It answers what ``transfer_trace.py`` (device timeline, under the profiler) cannot: how long the
host takes before the first DMA is issued, and which stage holds it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvtier.cuda import connector as connmod
from kvtier.cuda._driver import CudaDriver
from kvtier.cuda.bench import _arena, _calls, _make_case
from kvtier.cuda.kernels import LAUNCHES

MARKS: list[tuple[str, int, int]] = []


def _timed(orig: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``orig``, appending ``(tag, start, end)`` to MARKS for every call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return orig(*args, **kwargs)
        finally:
            MARKS.append((tag, t0, time.perf_counter_ns()))

    return call


def _wrap(owner: Any, name: str, label: str | None = None) -> None:
    raw = owner.__dict__.get(name) if isinstance(owner, type) else None
    if isinstance(raw, staticmethod):  # stays static: wrap the function inside
        setattr(owner, name, staticmethod(_timed(raw.__func__, label or name)))
    else:
        setattr(owner, name, _timed(getattr(owner, name), label or name))


def _instrument() -> None:
    for name in ("_groups", "_eager_piece", "_native_plan", "_prepare", "_plan", "_drv_store_piece", "_drv_load_dma",
                 "_drv_scatter", "_drv_table_up", "_flush_pending"):
        _wrap(connmod.CUDAPagedConnector, name)
    _wrap(connmod._Lane, "table_buffers")
    _wrap(LAUNCHES, "launch", "launch")
    _wrap(LAUNCHES, "copy_words", "copy_words")
    for name in ("memcpy_htod", "memcpy_dtoh", "record", "wait", "event_synchronize", "has_context"):
        _wrap(CudaDriver, name, "drv." + name)
    _wrap(torch.cuda, "current_stream", "torch.current_stream")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="small")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    case = _make_case(args.shape, args.chunks, _arena(args.chunks, [args.shape]), seed=3)
    conn = connmod.CUDAPagedConnector(case.caches, case.layout)
    calls = _calls(case, conn)
    plain: dict[str, float] = {}
    for name, fn in calls.items():
        for _ in range(5):
            fn()
        walls = []
        for _ in range(args.calls):
            torch.cuda.synchronize()
            t = time.perf_counter_ns()
            fn()
            torch.cuda.synchronize()
            walls.append(time.perf_counter_ns() - t)
        plain[name] = statistics.median(walls) / 1e3
    _instrument()
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        runs: list[tuple[float, list[tuple[str, float, float]]]] = []
        for _ in range(args.calls):
            torch.cuda.synchronize()
            MARKS.clear()
            t = time.perf_counter_ns()
            fn()
            t_ret = time.perf_counter_ns()
            torch.cuda.synchronize()
            t_end = time.perf_counter_ns()
            marks = [(n, (a - t) / 1e3, (b - a) / 1e3) for n, a, b in MARKS]
            runs.append(((t_end - t) / 1e3, [*marks, ("returned", (t_ret - t) / 1e3, 0.0)]))
        runs.sort(key=lambda r: r[0])
        wall = runs[len(runs) // 2][0]
        print(f"== {args.shape} {name}, {args.chunks} chunks: median wall {wall:.1f} us instrumented, "
              f"{plain[name]:.1f} us plain")
        # Per label: median start over all calls of its k-th occurrence (the stable picture).
        by_key: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for _, ms in runs:
            seen: dict[str, int] = {}
            for n, s, d in ms:
                k = seen.get(n, 0)
                seen[n] = k + 1
                by_key.setdefault((n, k), []).append((s, d))
        rows = sorted(
            ((statistics.median(s for s, _ in v), statistics.median(d for _, d in v), n, k)
             for (n, k), v in by_key.items() if len(v) >= len(runs) // 2),
        )
        for s, d, n, k in rows:
            if d >= 1.0 or n.startswith("drv.memcpy") or n in ("returned", "launch"):
                print(f"  {s:8.1f} +{d:7.1f} us  {n}#{k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

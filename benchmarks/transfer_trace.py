"""Where a transfer call's time goes, on a CUDA machine: a device timeline of one call.

``python benchmarks/transfer_trace.py [OUTDIR] [--shapes small 8b] [--chunks 16] [--stream N]`` runs
``store``, ``load`` and ``store_and_load_async`` once each (``--stream N``: a stream of N calls
of each through the ``_async`` API, as the bench's streamed rows; ``--only both``: just those;
``--only threads``: a store and a load from two threads started together, as the bench's "two
threads" variant;
``--set NAME=VALUE,...``: the connector's settings, see ``kvtier.cuda.bench._settings``) under ``torch.profiler`` (after
warm-up) for the benchmark's shapes, and prints, per call, every copy and kernel on the device relative to the call's start
on the host: when the first byte moved, the gaps between DMAs, and how long the host took to
return after the last one. It also prints the same call's host wall time without the profiler.
Chrome traces go to OUTDIR (default /tmp/kvtier-trace).

The numbers decide what to cut next: time before the first DMA is host preparation, gaps
between DMAs are pipeline stalls, time after the last DMA is the tail (a scatter, the wake-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvtier.cuda.bench import (
    SHAPES,
    _arena,
    _calls,
    _make_case,
    _Pair,
    _settings,
    _stream,
    _stream_calls,
)
from kvtier.cuda.connector import CUDAPagedConnector
from kvtier.cuda.kernels import LAUNCHES


def _timeline(trace: Path, label: str) -> list[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    marks = [e for e in events if e.get("name") == label and e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    if not marks:
        return [f"  (no annotation {label})"]
    t0, t1 = marks[0]["ts"], marks[0]["ts"] + marks[0]["dur"]
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
         and t0 - 5 <= e["ts"] <= t1 + 5),
        key=lambda e: e["ts"],
    )
    lines = [f"  host call {t1 - t0:8.1f} us"]
    dma_end_by_kind: dict[str, float] = {}
    for e in gpu:
        args = e.get("args", {})
        kind = "kernel" if e["cat"] == "kernel" else e["name"].replace("Memcpy ", "")
        size = f"{args.get('bytes', 0) / 2**20:7.2f} MiB" if "bytes" in args else " " * 11
        gap = ""
        if e["cat"] == "gpu_memcpy" and (args.get("bytes") or 0) > 1 << 20:
            prev = dma_end_by_kind.get(kind)
            if prev is not None:
                gap = f" gap {e['ts'] - prev:6.1f}"
            dma_end_by_kind[kind] = e["ts"] + e["dur"]
        lines.append(
            f"  {e['ts'] - t0:8.1f} +{e['dur']:7.1f} us  stream {args.get('stream', '?'):>3} {kind:<8} {size}{gap}"
        )
    if gpu:
        last = max(e["ts"] + e["dur"] for e in gpu)
        lines.append(f"  first device op at {gpu[0]['ts'] - t0:.1f} us; last ends {last - t0:.1f} us; "
                     f"host returns {t1 - last:.1f} us after it")
    return lines


def _issue_times(fn: Callable[[], object]) -> str:
    """When the host issued each DMA of at least 1 MiB, in one call without the profiler."""
    from kvtier.cuda._driver import CudaDriver

    issued: list[tuple[float, int]] = []
    originals = CudaDriver.memcpy_htod, CudaDriver.memcpy_dtoh

    def wrap(orig):  # type: ignore[no-untyped-def]
        def call(self, dst, src, nbytes, stream):  # type: ignore[no-untyped-def]
            if nbytes >= 1 << 20:
                issued.append((time.perf_counter(), nbytes))
            return orig(self, dst, src, nbytes, stream)

        return call

    CudaDriver.memcpy_htod, CudaDriver.memcpy_dtoh = (wrap(o) for o in originals)  # type: ignore[method-assign]
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        end = time.perf_counter()
    finally:
        CudaDriver.memcpy_htod, CudaDriver.memcpy_dtoh = originals  # type: ignore[method-assign]
    parts = [f"{n / 2**20:.0f}@{(t - t0) * 1e6:.0f}" for t, n in issued]
    return " ".join(parts) + f"; returned at {(end - t0) * 1e6:.0f}"


def _trace_shape(  # type: ignore[no-untyped-def]
    shape: str, chunks: int, arena, out: Path, stream: int = 0, in_flight: int = 2, settings: str = "",
    only: Sequence[str] = (),
) -> None:
    case = _make_case(shape, chunks, arena, seed=1)
    conn = CUDAPagedConnector(case.caches, case.layout)
    for name, value in _settings(settings, conn).items():
        setattr(conn, name, value)
    calls = (
        {f"stream{stream}-{name}": _stream(issue, stream, in_flight) for name, issue in _stream_calls(case, conn).items()}
        if stream else _calls(case, conn)
    )
    pair = None
    if "threads" in only and not stream:
        # A store and a load from two threads started together, as an engine's saver thread and
        # forward thread (the bench's "two threads" variant).
        pair = _Pair(calls["store"], calls["load"])
        calls["threads"] = pair
    for name, fn in calls.items():
        if only and name.rsplit("-", 1)[-1] not in only:
            continue
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        walls = []
        for _ in range(20):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t)
        label = f"{shape}-{name}"
        print(f"== {label}: host issued its DMAs (MiB@us from the call's start): " + _issue_times(fn))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(3):
                torch.cuda.synchronize()
                with record_function(f"{label}-{i}"):
                    fn()
                torch.cuda.synchronize()
        trace = out / f"trace-{label}.json"
        prof.export_chrome_trace(str(trace))
        print(f"== {label}: {case.nbytes / 2**20:.0f} MiB, median host wall "
              f"{statistics.median(walls) * 1e6:.1f} us without the profiler")
        print("\n".join(_timeline(trace, f"{label}-2")))
    if pair is not None:
        pair.close()
    print(f"  kept compiled launches: usable={LAUNCHES.usable} configurations={len(LAUNCHES.compiled)}")
    for o in case.store_objs + case.load_objs:
        o.release()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=Path("/tmp/kvtier-trace"), help="chrome traces go here")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["small", "8b"])
    ap.add_argument("--chunks", type=int, default=16, help="256-token chunks per call (default 16)")
    ap.add_argument("--stream", type=int, default=0,
                    help="trace a stream of this many _async calls instead of one call (bench's streamed rows)")
    ap.add_argument("--in-flight", type=int, default=2, help="with --stream: calls outstanding at most")
    ap.add_argument("--set", default="", help="connector settings NAME=VALUE,... (kvtier.cuda.bench._settings)")
    ap.add_argument("--only", nargs="+", default=(), choices=("store", "load", "retrieve", "both", "threads"),
                    help="trace only these calls")
    args = ap.parse_args()
    if "threads" in args.only and args.stream:
        ap.error("--only threads traces one call of the two-thread pair, not a --stream")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    arena = _arena(args.chunks, args.shapes)
    print(f"driver API: {os.environ.get('KVTIER_CUDA_DRIVER_API', '1')}")
    for shape in args.shapes:
        _trace_shape(shape, args.chunks, arena, out, args.stream, args.in_flight, args.set, args.only)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast a call's device work runs when the host's Python is taken away (CUDA machine).

``python benchmarks/transfer_replay.py [small:16 small:64 8b:16] [--rounds 25]`` records, for
``store``, ``load`` and ``store_and_load_async``, every driver call and kernel launch one call
issues (copies, event records and waits, host event waits, Triton launches, with their exact
arguments), then times:

- ``call``: the connector's call as the engine makes it (check, plan, issue, wait);
- ``replay``: the recorded operations issued again back to back from a list, then a device
  synchronise. Same bytes, same tables (the recorded call's table buffers are not touched
  again), same streams and order; no checking, no planning, no Python between operations but a
  loop. Its ``issue`` column is the host time of the driver calls and launches alone.

``--first-group 2,4,0`` adds ``store_and_load_async`` calls with other ``first_group_bytes`` (in
MiB; each direction's first group is twice that, 0 plans the whole call first): which schedule
would suit a host with cheaper planning.

So ``replay`` is what the same schedule reaches with host code that costs nothing but its
driver calls, the bound for any compiled or cached planner, and ``call - replay`` is what the
Python planning costs on this host. Also prints the contiguous pinned copy one way and both
ways (the limit), measured in the same rounds. Every call and its replay run on one connector,
interleaved round by round (each round records its calls afresh: a later call rewrites the
table buffers a recording copies from), so drift falls on all alike. Writes
``transfer-replay-<device>.json`` and ``.png``; ``--plot JSON`` redraws the PNG from a JSON file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.cuda import connector as cm
from kvtier.cuda._driver import CudaDriver, RawEvent
from kvtier.cuda.bench import _arena, _calls, _device_slug, _limit_calls, _make_case, _release
from kvtier.cuda.kernels import LAUNCHES

_DRIVER_OPS = ("memcpy_htod", "memcpy_dtoh", "record", "wait", "event_synchronize")
_ISSUING = ("memcpy_htod", "memcpy_dtoh", "record", "launch", "copy_words")


class _Recorder:
    """``record(fn)`` runs ``fn`` with every driver operation and launch appended to a list as
    it runs. The wrappers are in place only while recording: a timed call pays nothing for them."""

    def __init__(self) -> None:
        self.ops: list[tuple[Callable[..., Any], tuple, dict]] = []
        self._targets = [(CudaDriver, name) for name in _DRIVER_OPS] + [
            (LAUNCHES, name) for name in ("launch", "copy_words")
        ]

    def _wrapped(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        ops = self.ops

        def call(*args: Any, **kwargs: Any) -> Any:
            ops.append((orig, args, kwargs))
            return orig(*args, **kwargs)

        return call

    def record(self, fn: Callable[[], None]) -> list[tuple[Callable[..., Any], tuple, dict]]:
        torch.cuda.synchronize()
        self.ops = []
        saved = [(owner, name, owner.__dict__.get(name)) for owner, name in self._targets]
        for owner, name in self._targets:
            setattr(owner, name, self._wrapped(getattr(owner, name)))
        try:
            fn()
        finally:
            for owner, name, old in saved:
                if old is None:  # an instance method: drop the instance attribute again
                    delattr(owner, name)
                else:
                    setattr(owner, name, old)
        torch.cuda.synchronize()
        return self.ops


def _replay(ops: list[tuple[Callable[..., Any], tuple, dict]], issued: list[float]) -> None:
    """Issue ``ops`` and wait for the device; ``issued`` gets the host time up to the last copy,
    launch or event record (the call's final waits are not issue time)."""
    last = max((i for i, (fn, _, _) in enumerate(ops) if fn.__name__ in _ISSUING), default=-1)
    t0 = time.perf_counter()
    t_issued = t0
    for i, (fn, args, kwargs) in enumerate(ops):
        fn(*args, **kwargs)
        if i == last:
            t_issued = time.perf_counter()
    issued.append(t_issued - t0)
    torch.cuda.synchronize()


def run(rec: _Recorder, shape: str, chunks: int, rounds: int, first_groups: list[int]) -> list[dict]:
    arena = _arena(chunks, [shape])
    case = _make_case(shape, chunks, arena, seed=3)
    conn = cm.CUDAPagedConnector(case.caches, case.layout)
    calls = _calls(case, conn)
    both = calls["both"]
    default_first = conn._first_group_bytes
    for mib in first_groups:
        def both_with(mib: int = mib) -> None:
            conn._first_group_bytes = mib << 20
            try:
                both()
            finally:
                conn._first_group_bytes = default_first

        calls[f"both-first-{mib}MiB"] = both_with
    limits, release_limits = _limit_calls(case.nbytes, arena)
    names = ["limit one-way", "limit both"] + [f"{k} {v}" for k in calls for v in ("call", "replay")]
    times: dict[str, list[float]] = {k: [] for k in names}
    issue: dict[str, list[float]] = {k: [] for k in calls}

    def timed(name: str, fn: Callable[[], None]) -> None:
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)

    try:
        for fn in calls.values():
            for _ in range(5):
                fn()
        for r in range(rounds):
            timed("limit one-way", limits["store"])
            timed("limit both", limits["both"])
            for name, fn in calls.items():
                # Recorded afresh each round and replayed before any other call: later calls
                # rewrite the table buffers the recorded operations copy from.
                ops = rec.record(fn)
                if r == 0:
                    n_launch = sum(1 for f, _, _ in ops if f.__name__ in ("launch", "copy_words"))
                    print(f"{shape}:{chunks} {name}: {len(ops)} operations ({n_launch} launches)")
                _replay(ops, [])
                timed(f"{name} replay", lambda ops=ops, out=issue[name]: _replay(ops, out))
                timed(f"{name} call", fn)
    finally:
        release_limits()
        _release(case)
    one_way = case.nbytes / statistics.median(times["limit one-way"]) / 1e9
    print(f"== {shape}, {chunks} chunks a call ({case.nbytes / 2**20:.0f} MiB each way); "
          f"one-way limit {one_way:.1f} GB/s; median of {3 * rounds}")
    print(f"{'':28s} {'wall us':>9s} {'GB/s':>7s} {'x one-way':>9s} {'issue us':>9s}")
    rows = []
    for name, ts in times.items():
        m = statistics.median(ts)
        moved = case.nbytes * (2 if "both" in name else 1)
        gbps = moved / m / 1e9
        kind = name.rsplit(" ", 1)[0]
        iss = statistics.median(issue[kind]) * 1e6 if name.endswith("replay") else None
        rows.append({"shape": shape, "chunks": chunks, "call": name, "us": round(m * 1e6, 1),
                     "gbps": round(gbps, 2), "x_one_way_limit": round(gbps / one_way, 3),
                     "issue_us": None if iss is None else round(iss, 1)})
        tail = f" {iss:9.1f}" if iss is not None else ""
        print(f"{name:28s} {m * 1e6:9.1f} {gbps:7.1f} {gbps / one_way:9.3f}{tail}")
    return rows


def _plot(result: dict, path: Path) -> bool:
    """Bars per case and call: the call and its replay as multiples of the one-way limit, with
    the plain copy's level drawn over each; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["results"]
    cases = list(dict.fromkeys((r["shape"], r["chunks"]) for r in rows))
    kinds = ["store", "load", "both"]
    groups = [(c, k) for c in cases for k in kinds]

    def ratio(case: tuple[str, int], call: str) -> float:
        match = [r for r in rows if (r["shape"], r["chunks"]) == case and r["call"] == call]
        return match[0]["x_one_way_limit"] if match else 0.0

    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.38
    xs = range(len(groups))
    ax.bar([x - width / 2 for x in xs], [ratio(c, f"{k} call") for c, k in groups], width, label="call (Python plans)")
    ax.bar([x + width / 2 for x in xs], [ratio(c, f"{k} replay") for c, k in groups], width,
           label="replay (same device work, no planning)")
    for x, (c, k) in zip(xs, groups, strict=True):
        level = ratio(c, "limit both" if k == "both" else "limit one-way")
        ax.hlines(level, x - 0.45, x + 0.45, colors="k", lw=1.2, label="contiguous pinned copy" if x == 0 else None)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{s}:{n}\n{k}" for (s, n), k in groups], fontsize=8)
    ax.set_ylabel("x the one-way contiguous copy")
    ax.set_title(f"kvtier-cuda calls vs their replayed device work, {result['device']}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=["small:16", "small:64", "8b:16"], help="shape:chunks")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--plot", type=Path, help="only redraw the PNG of this JSON file")
    ap.add_argument("--first-group", default="", help="also both at once with these first_group_bytes, MiB, "
                    "comma-separated (0: the whole call planned first); not drawn")
    args = ap.parse_args()
    if args.plot is not None:
        return 0 if _plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png")) else 2
    if not torch.cuda.is_available():
        print("needs an NVIDIA GPU")
        return 2
    RawEvent.__del__ = lambda self: None  # type: ignore[method-assign]  # recorded handles stay valid
    rec = _Recorder()
    rows = []
    for case in args.cases:
        shape, chunks = case.split(":")
        rows += run(rec, shape, int(chunks), args.rounds,
                    [int(x) for x in args.first_group.split(",") if x.strip()])
        torch.cuda.empty_cache()
    slug = _device_slug(torch.cuda.get_device_name())
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"transfer-replay-{slug}.json"
    result = {"device": torch.cuda.get_device_name(), "results": rows}
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    if _plot(result, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

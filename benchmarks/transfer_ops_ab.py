"""A connector switch on and off, an A/B on one GPU machine: by default the C op runner
(``_native_ops``: driver calls issued by one C call per step, ``OpBatch``, or one ctypes call
each); ``--knob NAME`` flips another boolean attribute of the connector (``_load_table_by_kernel``,
``_whole_when_busy``, ``_eager_load``, ...); ``--on SETTINGS --off SETTINGS --name NAME``
compares two sets of settings (``NAME=VALUE,...``, see ``kvtier.cuda.bench._settings``), e.g.
``--on _both_lead=store,_both_store_first_bytes=4MiB --off _both_lead=load --name store-leads``.

``python benchmarks/transfer_ops_ab.py small:16 small:64 8b:16 [--knob NAME] [--out DIR]`` times,
for each ``shape:chunks``, a store, a load and ``store_and_load_async`` (one call, waited, and a
stream of ``--stream-calls`` calls, at most ``--in-flight`` outstanding) on one connector with
the switch on and off, switched call by call, every setting in every round
(``kvtier.cuda.bench._ab_medians``), with the contiguous pinned copy for reference. Figures are
medians as ratios to the one-way limit of the same kind (a call against one copy, a stream
against a stream of copies; both directions against the one-way limit), and the host time until
each ``_async`` call returns. Written to ``transfer-ops-ab-<device>.json`` (another knob:
``transfer-<knob>-ab-<device>.json``; two sets of settings: ``transfer-<name>-ab-<device>.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.cuda import connector as cm
from kvtier.cuda.bench import (
    _ab_cases,
    _ab_limits,
    _ab_medians,
    _ab_streamed_rows,
    _arena,
    _calls,
    _limit_stream_calls,
    _make_case,
    _release,
    _settings,
    _stream,
    _stream_calls,
    _write_ab,
)


def run(
    shape: str, chunks: int, rounds: int, stream_calls: int, in_flight: int, knob: str = "_native_ops",
    arms: tuple[str, str] | None = None,
) -> list[dict]:
    """``arms``: the settings of the two arms (``on``, ``off``) instead of ``knob`` on and off."""
    arena = _arena(chunks, [shape])
    case = _make_case(shape, chunks, arena, seed=3)
    conn = cm.CUDAPagedConnector(case.caches, case.layout)
    if arms is not None:
        try:
            setting = {True: _settings(arms[0], conn), False: _settings(arms[1], conn)}
        except ValueError as e:
            raise SystemExit(str(e)) from None
    else:
        if knob == "_native_ops" and conn._store_lane.ops is None:
            raise SystemExit("the host module did not build: no C op runner to compare")
        if not isinstance(getattr(conn, knob, None), bool):
            raise SystemExit(f"{knob} is not a boolean attribute of the connector")
        setting = {True: {knob: True}, False: {knob: False}}
    one = _calls(case, conn)
    streams = _stream_calls(case, conn)
    limit_issues, release_limits = _limit_stream_calls(case.nbytes, arena)
    names = set(setting[True]) | set(setting[False])
    default = {name: getattr(conn, name) for name in names}
    label = {True: "C ops", False: "ctypes"} if knob == "_native_ops" and arms is None else {True: "on", False: "off"}

    def apply(on: bool | None) -> Callable[[], None]:
        values = default if on is None else {**default, **setting[on]}

        def set_() -> None:
            for name, value in values.items():
                setattr(conn, name, value)
        return set_

    keep = apply(None)
    calls = _ab_limits(limit_issues, stream_calls, in_flight, keep)
    for direction in ("store", "load", "both"):
        for on in (True, False):
            how = label[on]
            calls[f"{direction} {how}"] = (one[direction], apply(on))
            issue = streams["retrieve" if direction == "load" else direction]
            calls[f"{direction} streamed {how}"] = (_stream(issue, stream_calls, in_flight), apply(on))
    try:
        medians = _ab_medians(calls, rounds)
        issue = _issue_seconds(streams, apply, rounds, label)
    finally:
        keep()
        release_limits()
        _release(case)
    rows = _ab_streamed_rows(shape, chunks, case.nbytes, medians, rounds, stream_calls, in_flight, 40)
    for name, seconds in issue.items():
        print(f"{name:40s} {seconds * 1e6:9.1f} us to return (host time, copies not waited)")
        rows.append({"shape": shape, "chunks": chunks, "call": name, "issue_us": round(seconds * 1e6, 1)})
    return rows


def _issue_seconds(
    streams: dict[str, Callable[[], list]], apply: Callable[[bool], Callable[[], None]], rounds: int,
    label: dict[bool, str],
) -> dict[str, float]:
    """Median host time until each ``_async`` call returns (its copies waited for afterwards,
    untimed), runner on and off in turn: the host time a call takes from the engine's thread."""
    times: dict[str, list[float]] = {}
    for _ in range(3 * rounds):
        for direction, key in (("store", "store"), ("load", "retrieve"), ("both", "both")):
            for on in (True, False):
                apply(on)()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                pending = streams[key]()
                dt = time.perf_counter() - t0
                for p in pending:
                    p.wait()
                times.setdefault(f"{direction} issue {label[on]}", []).append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="shape:chunks, e.g. small:16")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--stream-calls", type=int, default=8)
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--knob", default="_native_ops", help="the connector's boolean attribute to flip")
    ap.add_argument("--on", help="the first arm's settings, NAME=VALUE,... (with --off and --name)")
    ap.add_argument("--off", default="", help="the second arm's settings, NAME=VALUE,...")
    ap.add_argument("--name", help="with --on: the results' name (transfer-<name>-ab-<device>.json)")
    ap.add_argument("--suffix", default="")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs an NVIDIA GPU")
        return 2
    if args.on is not None and not args.name:
        ap.error("--on needs --name")
    arms = (args.on, args.off) if args.on is not None else None
    rows = _ab_cases(
        args.cases,
        lambda shape, chunks: run(shape, chunks, args.rounds, args.stream_calls, args.in_flight, args.knob, arms),
    )
    if arms is not None:
        print(f"on: {args.on}; off: {args.off or '(defaults)'}")
        stem = f"transfer-{args.name}-ab"
    elif args.knob == "_native_ops":
        stem = "transfer-ops-ab"
    else:
        stem = f"transfer-{args.knob.strip('_').replace('_', '-')}-ab"
    _write_ab(rows, args.out, stem, args.suffix)
    return 0


if __name__ == "__main__":
    sys.exit(main())

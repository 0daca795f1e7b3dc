"""How ``store_and_load_async`` should start both directions: an A/B on one GPU machine.

``python benchmarks/transfer_both_ab.py small:16 small:64 8b:16 [--out DIR]`` times, for each
``shape:chunks``, one ``store_and_load_async`` call (both waited) and a stream of them (``--stream-calls``
calls back to back, at most ``--in-flight`` outstanding), under several start-up settings, with
the contiguous pinned copy one way and both ways, each once as a call and once as a stream, for
reference.

A setting is ``lead/eager/store-first-MiB``:

- ``lead``: ``load`` (the load's first step goes first: its early DMA, or its first group
  planned and its first DMA issued) or ``store`` (the store's whole first batch first);
- ``eager``: 1 starts the load's first DMA before its group is checked and planned
  (``CUDAPagedConnector._eager_piece``), 0 plans first;
- ``store-first-MiB``: the store's first group (0: twice ``first_group_bytes``, as the load's).

All settings run on one connector, switched call by call, every setting in every round
(``kvtier.cuda.bench._ab_medians``). Figures are medians, as ratios to the one-way limit of
the same kind: a call against one contiguous copy, a stream (its time per call) against a stream
of contiguous copies, which runs ~5% faster than single ones. Written to
``transfer-both-ab-<device>.json``.
"""

from __future__ import annotations

import argparse
import sys
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
    _stream,
    _stream_calls,
    _write_ab,
)

SETTINGS = "load/1/0,load/0/0,store/1/4,store/1/8,store/0/8"
Setting = tuple[str, bool, int]


def _settings(text: str) -> list[Setting]:
    out = []
    for item in text.split(","):
        lead, eager, mib = item.split("/")
        if lead not in ("store", "load"):
            raise ValueError(f"lead must be store or load, got {lead!r} in {item!r}")
        out.append((lead, bool(int(eager)), int(mib) << 20))
    return out


def run(shape: str, chunks: int, rounds: int, settings: list[Setting], stream_calls: int, in_flight: int) -> list[dict]:
    arena = _arena(chunks, [shape])
    case = _make_case(shape, chunks, arena, seed=3)
    conn = cm.CUDAPagedConnector(case.caches, case.layout)
    one_call = _calls(case, conn)["both"]
    streamed = _stream(_stream_calls(case, conn)["both"], stream_calls, in_flight)
    limit_issues, release_limits = _limit_stream_calls(case.nbytes, arena)
    default: Setting = (conn._both_lead, conn._both_eager, conn._both_store_first_bytes)

    def apply(setting: Setting) -> Callable[[], None]:
        def set_() -> None:
            conn._both_lead, conn._both_eager, conn._both_store_first_bytes = setting
        return set_

    keep = apply(default)
    calls = _ab_limits(limit_issues, stream_calls, in_flight, keep)
    for setting in settings:
        lead, eager, first = setting
        name = f"{lead} leads, {'eager' if eager else 'planned'} load, store first {(first >> 20) or 'x2'}"
        calls[f"both {name}"] = (one_call, apply(setting))
        calls[f"streamed {name}"] = (streamed, apply(setting))
    try:
        medians = _ab_medians(calls, rounds)
    finally:
        keep()
        release_limits()
        _release(case)
    return _ab_streamed_rows(shape, chunks, case.nbytes, medians, rounds, stream_calls, in_flight, 62)

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="shape:chunks, e.g. small:16")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--settings", default=SETTINGS, help="lead/eager/store-first-MiB, comma-separated")
    ap.add_argument("--stream-calls", type=int, default=8)
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--suffix", default="")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs an NVIDIA GPU")
        return 2
    settings = _settings(args.settings)
    rows = _ab_cases(
        args.cases, lambda shape, chunks: run(shape, chunks, args.rounds, settings, args.stream_calls, args.in_flight)
    )
    _write_ab(rows, args.out, "transfer-both-ab", args.suffix)
    return 0


if __name__ == "__main__":
    sys.exit(main())

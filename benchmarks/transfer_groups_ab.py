"""How large a whole-chunk call's first group should be: an A/B on one GPU machine.

``python benchmarks/transfer_groups_ab.py small:16 small:64 8b:16 [--out DIR]`` times, for each
``shape:chunks``, ``store``, ``load`` and ``store_and_load_async`` under several
(``first_group_bytes``, growth) settings, plus the contiguous pinned copy one way and both ways.
All settings run on one connector instance (its staging ring and table buffers stay the same:
separate instances measured up to 0.1x apart with identical plans), switched call by call, and
every setting runs in every round, so a shared machine's drift falls on all of them alike. Each
figure is the median over rounds, printed as a ratio to the one-way limit and written to
``transfer-groups-ab-<device>.json``.

``store_and_load_async`` prepares each direction's first group at twice ``first_group_bytes``
(see ``CUDAPagedConnector._groups``): the rows name the sizes each call prepares first. ``--settings`` takes
``MiB:growth:eager`` triples; ``growth`` is how much larger each later group is, for stores and
both at once, optionally ``/`` that for lone loads (``2/4``, the default; one number sets both);
``eager`` 0 turns off a lone load's early first DMA (``CUDAPagedConnector._eager_piece``, which
also doubles its first group). A setting whose rows repeat another's (same name) is measured
once.
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
    _ab_medians,
    _ab_row,
    _arena,
    _calls,
    _limit_calls,
    _make_case,
    _release,
    _write_ab,
)

# first_group_bytes in MiB : growth (stores and both at once[/lone loads]) : a lone load's early DMA
SETTINGS = "8:2/4:1,8:4:1,4:2/4:1,8:2/4:0"
Setting = tuple[int, int, int, bool]


def _settings(text: str) -> list[Setting]:
    out = []
    for item in text.split(","):
        mib, growth, eager = item.split(":")
        store_growth, _, load_growth = growth.partition("/")
        out.append((int(mib) << 20, int(store_growth), int(load_growth or store_growth), bool(int(eager))))
    return out


def run(shape: str, chunks: int, rounds: int, settings: list[Setting]) -> list[dict]:
    arena = _arena(chunks, [shape])
    case = _make_case(shape, chunks, arena, seed=3)
    conn = cm.CUDAPagedConnector(case.caches, case.layout)
    calls_of = _calls(case, conn)
    limits, release_limits = _limit_calls(case.nbytes, arena)
    # name -> (call, setting); limits ignore the settings
    default: Setting = (conn._first_group_bytes, cm._GROUP_GROWTH, cm._LOAD_GROUP_GROWTH, conn._eager_load)
    calls: dict[str, tuple[Callable[[], None], Setting]] = {
        "limit one-way": (limits["store"], default),
        "limit both": (limits["both"], default),
    }
    for setting in settings:
        first, growth, load_growth, eager = setting
        mib = first >> 20
        late = "" if eager else " late-load"
        calls[f"both first {2 * mib} MiB/dir x{growth}{late}"] = (calls_of["both"], setting)
        calls[f"store first {mib} MiB x{growth}{late}"] = (calls_of["store"], setting)
        # A lone load with its early DMA prepares twice the first group (see _groups).
        calls[f"load first {2 * mib if eager else mib} MiB x{load_growth}{late}"] = (calls_of["load"], setting)

    def apply(setting: Setting) -> Callable[[], None]:
        def set_() -> None:
            conn._first_group_bytes, cm._GROUP_GROWTH, cm._LOAD_GROUP_GROWTH, conn._eager_load = setting
        return set_

    try:
        medians = _ab_medians({name: (fn, apply(setting)) for name, (fn, setting) in calls.items()}, rounds)
    finally:
        apply(default)()
        release_limits()
        _release(case)
    one_way = case.nbytes / medians["limit one-way"] / 1e9
    print(f"== {shape}, {chunks} chunks a call ({case.nbytes / 2**20:.0f} MiB each way); "
          f"one-way limit {one_way:.1f} GB/s; median of {3 * rounds}")
    order = list(medians)
    return [
        _ab_row(shape, chunks, name, medians[name],
                case.nbytes * (2 if name.startswith(("both", "limit both")) else 1), one_way, 30)
        for name in sorted(medians, key=lambda k: (k.split()[0], order.index(k)))
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="shape:chunks, e.g. small:16")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--settings", default=SETTINGS, help="first-group MiB:growth:eager, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs an NVIDIA GPU")
        return 2
    settings = _settings(args.settings)
    rows = _ab_cases(args.cases, lambda shape, chunks: run(shape, chunks, args.rounds, settings))
    _write_ab(rows, args.out, "transfer-groups-ab")
    return 0


if __name__ == "__main__":
    sys.exit(main())

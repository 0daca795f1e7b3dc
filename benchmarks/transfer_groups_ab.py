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
(see ``CUDAPagedConnector._groups``): the rows name both sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.cuda import connector as cm
from kvtier.cuda.bench import _chunk_nbytes, _device_slug, _limit_calls, _make_case
from kvtier.cuda.platform import CUDAPlatform

SETTINGS = [(4 << 20, 4), (8 << 20, 4), (8 << 20, 8), (16 << 20, 4)]  # (first_group_bytes, growth)


def run(shape: str, chunks: int, rounds: int) -> list[dict]:
    # Room for the store and load objects and the two plain copies' buffers, as in the bench.
    arena = CUDAPlatform().create_arena(4 * chunks * _chunk_nbytes(shape) + (64 << 20))
    case = _make_case(shape, chunks, arena, seed=3)
    stores, loads = case.store_transfers(), case.load_transfers()
    conn = cm.CUDAPagedConnector(case.caches, case.layout)

    def both() -> None:
        for pending in conn.store_and_load_async(stores, loads):
            pending.wait()

    limits, release_limits = _limit_calls(case.nbytes, arena)
    # name -> (call, first_group_bytes, growth); limits ignore the settings
    calls: dict[str, tuple[Callable[[], None], int, int]] = {
        "limit one-way": (limits["store"], 0, 4),
        "limit both": (limits["both"], 0, 4),
    }
    for first, growth in SETTINGS:
        mib = first >> 20
        calls[f"both first {2 * mib} MiB/dir x{growth}"] = (both, first, growth)
        calls[f"store first {mib} MiB x{growth}"] = (lambda: conn.store(stores), first, growth)
        calls[f"load first {mib} MiB x{growth}"] = (lambda: conn.load(loads), first, growth)
    times: dict[str, list[float]] = {k: [] for k in calls}
    try:
        for fn, first, growth in calls.values():
            conn._first_group_bytes, cm._GROUP_GROWTH = first, growth
            for _ in range(3):
                fn()
        for _ in range(rounds):
            for name, (fn, first, growth) in calls.items():
                conn._first_group_bytes, cm._GROUP_GROWTH = first, growth
                for _ in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
    finally:
        cm._GROUP_GROWTH = 4
        release_limits()
        for o in case.store_objs + case.load_objs:
            o.release()
    one_way = case.nbytes / statistics.median(times["limit one-way"]) / 1e9
    print(f"== {shape}, {chunks} chunks a call ({case.nbytes / 2**20:.0f} MiB each way); "
          f"one-way limit {one_way:.1f} GB/s; median of {3 * rounds}")
    rows = []
    order = list(times)
    for name in sorted(times, key=lambda k: (k.split()[0], order.index(k))):
        m = statistics.median(times[name])
        moved = case.nbytes * (2 if name.startswith(("both", "limit both")) else 1)
        gbps = moved / m / 1e9
        rows.append({"shape": shape, "chunks": chunks, "call": name, "us": round(m * 1e6, 1),
                     "gbps": round(gbps, 2), "x_one_way_limit": round(gbps / one_way, 3)})
        print(f"{name:30s} {m * 1e6:9.1f} us  {gbps:6.1f} GB/s  {gbps / one_way:5.3f}x one-way limit")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="shape:chunks, e.g. small:16")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs an NVIDIA GPU")
        return 2
    rows = []
    for case in args.cases:
        shape, chunks = case.split(":")
        rows += run(shape, int(chunks), args.rounds)
        torch.cuda.empty_cache()
    slug = _device_slug(torch.cuda.get_device_name())
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"transfer-groups-ab-{slug}.json"
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

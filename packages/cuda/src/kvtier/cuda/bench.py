"""``kvtier bench transfer``: paged KV <-> pinned host throughput on one NVIDIA GPU.

In one run, per model shape (8B: 32 layers, 8 kv heads, head 128; small: 16 layers, 2 kv heads,
head 64; bf16, block 16, chunks of 256 tokens, flash-attn layout), it measures:

- ``limit``: one contiguous pinned-host copy of the same bytes, each direction, and both
  directions at once on two streams (what PCIe and the copy engines can do);
- ``torch``: core's TorchPagedConnector (index_select / index_copy_ per layer + copy);
- ``kvtier``: the CUDA connector (default options), store, retrieve, and both at once
  (``store_and_load_async`` from one thread); ``kvtier-two-threads``: a store and a load from
  two threads at once (an engine's saver and forward threads).

Every path's bytes are checked against the torch reference before timing. Times are host wall-clock medians of whole calls (each call returns
with its copies done), so host overhead counts. The rows the targets are read from (the limit,
kvtier's three calls and the streams) are measured together, each call once per round in turn,
so drift during the run falls on the reference and kvtier alike (``_measure_paired``).

It also measures a *stream* of calls (``streamed`` in the JSON): ``--stream-calls`` calls issued
back to back with the ``_async`` API, at most ``--in-flight`` of them outstanding (the caller
waits for the oldest before issuing another), as an engine's saver and loader keep transfers going;
the limit's stream is the same number of contiguous copies queued back to back. One call's
rows include its pipeline's fill and drain and the host work before its first DMA; a stream
overlaps them with the previous call's bytes, so it measures sustained throughput.
Writes ``transfer-<device>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.core.connector import TorchPagedConnector
from kvtier.core.layout import PagedLayout
from kvtier.core.memory import HostArena
from kvtier.cuda.bench_cases import (
    BLOCK,
    CHUNK,
    DUPLEX_TARGET,
    SHAPES,
    TARGETS,
    Case,
    Pair,
    async_calls,
    bench_arena,
    check,
    device_slug,
    interleaved_medians,
    limit_calls,
    make_case,
    median_seconds,
    release_case,
    stream,
    waited,
    whole_calls,
)


def _measure_paired(
    case: Case,
    conn,
    arena: HostArena,
    repeat: int,
    warmup: int,
    stream_calls: int,
    in_flight: int,
) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float]]:
    """The rows the targets are read from, measured together: seconds per call of the limit
    (``limit_calls``) and of ``conn`` (``store``, ``retrieve``, ``both``: one call each),
    and, with ``stream_calls``, of both as streams (``stream``, per call). Every call runs once
    per round, in turn (``interleaved_medians``), so a machine whose PCIe or host speed drifts during
    the run (seen on shared H200 hosts: the plain copy both ways from 1.69x to 1.84x the
    one-way copy within one session) slows the reference and kvtier alike.

    Returns ``(limit, kvtier, limit streamed, kvtier streamed)``; the streamed dicts are empty
    without ``stream_calls``."""
    issues, release = limit_calls(case.nbytes, arena)
    mine = whole_calls(case, conn)
    mine_async = async_calls(case, conn)
    calls: dict[str, Callable[[], None]] = {}
    for d in ("store", "retrieve", "both"):
        calls[f"limit {d}"] = waited(issues[d])
        calls[f"kvtier {d}"] = mine["load" if d == "retrieve" else d]
        if stream_calls > 0:
            calls[f"limit-streamed {d}"] = stream(issues[d], stream_calls, in_flight)
            calls[f"kvtier-streamed {d}"] = stream(mine_async[d], stream_calls, in_flight)
    try:
        medians = interleaved_medians(
            {k: (fn, _nothing) for k, fn in calls.items()}, repeat, per_round=1, warmup=warmup
        )
    finally:
        release()
    out: tuple[dict[str, float], ...] = ({}, {}, {}, {})
    for k, m in medians.items():
        impl, d = k.split()
        i = ("limit", "kvtier", "limit-streamed", "kvtier-streamed").index(impl)
        out[i][d] = m / (stream_calls if i >= 2 else 1)
    return out[0], out[1], out[2], out[3]


def _nothing() -> None:
    pass


def _measure_connector(case: Case, conn, repeat: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of ``store`` and ``retrieve``."""
    calls = whole_calls(case, conn)
    return {
        "store": median_seconds(calls["store"], repeat, warmup),
        "retrieve": median_seconds(calls["load"], repeat, warmup),
    }


def _two_threads(case: Case, conn, repeat: int, warmup: int) -> dict[str, float]:
    """Median seconds of a store and a load called at once from two threads (``both``)."""
    calls = whole_calls(case, conn)
    pair = Pair(calls["store"], calls["load"])
    try:
        return {"both": median_seconds(pair, repeat, warmup)}
    finally:
        pair.close()


def _rows(
    shape: str, impl: str, seconds: dict[str, float], nbytes: int, limit_gbps: dict[str, float]
) -> list[dict]:
    rows = []
    one_way = (limit_gbps["store"] + limit_gbps["retrieve"]) / 2
    for direction, s in seconds.items():
        moved = nbytes * (2 if direction == "both" else 1)
        gbps = moved / s / 1e9
        row = {
            "shape": shape,
            "direction": direction,
            "impl": impl,
            "gbps": round(gbps, 2),
            "ratio_to_limit": round(gbps / limit_gbps[direction], 3),
            "bytes": moved,
            "seconds": s,
        }
        if direction == "both":
            # The duplex target: both directions at once vs one direction of the contiguous copy.
            row["x_one_direction_limit"] = round(gbps / one_way, 3)
        rows.append(row)
    return rows


def _plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["results"] + [
        r for r in result.get("streamed", []) if r["impl"] == "kvtier-streamed"
    ]
    groups = [(s, d) for s in SHAPES for d in ("store", "retrieve", "both")]
    impls = ["torch", "kvtier", "kvtier-streamed", "kvtier-two-threads"]
    impls = [i for i in impls if any(r["impl"] == i for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        ys = []
        for s, d in groups:
            match = [
                r for r in rows if r["shape"] == s and r["direction"] == d and r["impl"] == impl
            ]
            ys.append(match[0]["ratio_to_limit"] if match else 0.0)
        ax.bar([g + k * width for g in range(len(groups))], ys, width, label=impl)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([g + width for g in range(len(groups))])
    ax.set_xticklabels([f"{s}\n{d}" for s, d in groups])
    ax.set_ylabel("fraction of the contiguous pinned copy")
    ax.set_title(
        f"paged KV transfer on {result['device']} (limit: "
        + ", ".join(
            f"{r['shape']} {r['direction']} {r['gbps']} GB/s"
            for r in result["results"]
            if r["impl"] == "limit" and r["shape"] == "8b"
        )
        + ")",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvtier bench transfer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--chunks", type=int, default=16, help="256-token chunks per call (default 16)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--device-name", help="name in the output files (default: from the GPU)")
    ap.add_argument("--suffix", default="", help="appended to the output file names")
    ap.add_argument(
        "--stream-calls",
        type=int,
        default=8,
        help="calls per stream in the streamed rows (default 8; 0 skips them)",
    )
    ap.add_argument(
        "--in-flight",
        type=int,
        default=2,
        help="streamed rows: most calls outstanding at once (default 2)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kvtier bench transfer needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        return 2

    from kvtier.cuda.connector import CUDAPagedConnector

    name = torch.cuda.get_device_name()
    slug = args.device_name or device_slug(name)
    arena = bench_arena(args.chunks, args.shapes)
    results: list[dict] = []
    streamed: list[dict] = []
    print(
        f"device: {name}; {args.chunks} chunks of {CHUNK} tokens per call; median of {args.repeat}"
    )
    print(f"{'shape':<6} {'direction':<9} {'impl':<22} {'GB/s':>7} {'ratio':>6}")
    for shape in args.shapes:
        case = make_case(shape, args.chunks, arena, seed=len(results))
        conn = CUDAPagedConnector(case.caches, case.layout)
        check(case, conn, "kvtier")
        limit_s, kvtier_s, stream_limit_s, stream_s = _measure_paired(
            case, conn, arena, args.repeat, args.warmup, args.stream_calls, args.in_flight
        )
        limit_gbps = {
            d: case.nbytes * (2 if d == "both" else 1) / s / 1e9 for d, s in limit_s.items()
        }
        rows = _rows(shape, "limit", limit_s, case.nbytes, limit_gbps)
        torch_conn = TorchPagedConnector(case.caches, case.layout)
        rows += _rows(
            shape,
            "torch",
            _measure_connector(case, torch_conn, max(3, args.repeat // 4), 1),
            case.nbytes,
            limit_gbps,
        )
        rows += _rows(shape, "kvtier", kvtier_s, case.nbytes, limit_gbps)
        results += rows
        # An engine's saver and forward threads: a store and a load from two threads at once.
        trows = [
            r
            for r in _rows(
                shape,
                "kvtier-two-threads",
                _two_threads(case, conn, args.repeat, args.warmup),
                case.nbytes,
                limit_gbps,
            )
            if r["direction"] == "both"
        ]
        results += trows
        rows += trows
        if stream_s:
            stream_gbps = {
                d: case.nbytes * (2 if d == "both" else 1) / s / 1e9
                for d, s in stream_limit_s.items()
            }
            srows = _rows(shape, "limit", stream_limit_s, case.nbytes, stream_gbps) + _rows(
                shape, "kvtier", stream_s, case.nbytes, stream_gbps
            )
            for r in srows:
                r["impl"] += "-streamed"
                r["calls_per_stream"] = args.stream_calls
                r["in_flight"] = args.in_flight
            streamed += srows
            rows += srows
        for r in rows:
            extra = (
                f"  ({r['x_one_direction_limit']}x one-way limit)"
                if "x_one_direction_limit" in r
                else ""
            )
            print(
                f"{r['shape']:<6} {r['direction']:<9} {r['impl']:<22} {r['gbps']:>7.2f} {r['ratio_to_limit']:>6.3f}{extra}"
            )
        release_case(case)
        del conn, torch_conn, case
        torch.cuda.empty_cache()
    result = {
        "benchmark": "transfer",
        "device": name,
        "device_slug": slug,
        "torch": torch.__version__,
        "chunks_per_call": args.chunks,
        "chunk_tokens": CHUNK,
        "block_size": BLOCK,
        "dtype": "bfloat16",
        "layout": PagedLayout.FLASH_NHD.value,
        "timing": (
            "host wall-clock median of whole calls (copies complete on return); the limit, kvtier and streamed "
            "rows measured together, each call once per round in turn"
        ),
        "targets": {"per_direction": TARGETS, "both_x_one_direction_limit": DUPLEX_TARGET},
        "verified_against_torch_reference": True,
        "results": results,
        "streamed": streamed,
        "streamed_timing": (
            f"host wall-clock median of {args.stream_calls} calls issued back to back (the _async API, at most "
            f"{args.in_flight} outstanding), divided by the calls; the limit: as many contiguous copies queued back to back"
        )
        if streamed
        else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"transfer-{slug}{'-' + args.suffix if args.suffix else ''}"
    out = args.out / f"{stem}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if _plot(result, args.out / f"{stem}.png"):
        print(f"wrote {args.out / f'{stem}.png'}")
    return 0

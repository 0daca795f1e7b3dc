"""``kvtier bench transfer``: paged KV <-> pinned host throughput on one NVIDIA GPU.

For each model shape (8B: 32 layers, 8 kv heads, head 128; small: 16 layers, 2 kv heads, head 64;
bf16, block 16, chunks of 256 tokens) and each of vLLM's KV cache layouts, over views placed as
vLLM 0.32's ``allocate_kv_cache`` places them, one run measures:

- ``limit``: one contiguous pinned-host copy of the same bytes, each direction, and both at once
  on two streams (what PCIe and the copy engines can do);
- ``kvtier``: the CUDA page mover's ``store`` and ``load`` of a call's chunks, and ``both``: a
  store and a load called at once from two threads (an engine's saver and forward threads);
- ``limit-threads``: the plain copies called at once from two such threads, the reference for
  ``kvtier both`` with the threads' hand-offs in both (``x_threaded_limit``);
- ``kvtier-streamed`` / ``limit-streamed`` (``--stream-shapes``): ``--stream-calls`` calls back
  to back, per call, against as many limit copies back to back;
- ``torch``: core's ``TorchPageMover`` (``index_select``/``index_copy_`` + copy);
- ``block-dma`` (block-outer, block-compact layouts): one DMA per block from Python, the
  alternative the layout-preference decision weighs.

Every mover's bytes are checked against the torch reference before timing. Times are host
wall-clock medians of whole calls (each returns with its copies done), so host overhead counts.
The limit and the mover are measured together, each call once per round in turn, so drift during
the run falls on both alike. Writes ``transfer-<device>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvtier.bench.transfer_cases import (
    BLOCK,
    CHUNK,
    DUPLEX_TARGET,
    SHAPES,
    TARGETS,
    Call,
    Case,
    Pair,
    bench_arena,
    block_dma_calls,
    check,
    device_slug,
    interleaved_medians,
    limit_calls,
    make_case,
    repeated,
)
from kvtier.core.layout import PagedLayout
from kvtier.core.memory import HostArena
from kvtier.core.platform.mover import TorchPageMover

LAYOUTS = [p.value for p in PagedLayout]


def _rows(
    case: Case, impl: str, seconds: dict[str, float], limit_gbps: dict[str, float]
) -> list[dict]:
    rows = []
    one_way = (limit_gbps["store"] + limit_gbps["load"]) / 2
    for direction, s in seconds.items():
        moved = case.nbytes * (2 if direction == "both" else 1)
        gbps = moved / s / 1e9
        row = {
            "shape": case.shape,
            "layout": case.layout.paged_layout.value,
            "direction": direction,
            "impl": impl,
            "gbps": round(gbps, 2),
            "ratio_to_limit": round(gbps / limit_gbps[direction], 3),
            "bytes": moved,
            "seconds": s,
        }
        if direction == "both":
            # The duplex target: both directions at once vs one direction of the plain copy.
            row["x_one_direction_limit"] = round(gbps / one_way, 3)
        rows.append(row)
    return rows


def _threaded(rows: list[dict], impl: str, reference: str) -> None:
    """``impl``'s both-at-once row gains ``x_threaded_limit``: its rate over the plain copies'
    called from the same two threads."""
    both = {r["impl"]: r for r in rows if r["direction"] == "both"}
    if impl in both and reference in both:
        both[impl]["x_threaded_limit"] = round(both[impl]["gbps"] / both[reference]["gbps"], 3)


def _gbps(case: Case, seconds: dict[str, float]) -> dict[str, float]:
    return {d: case.nbytes * (2 if d == "both" else 1) / s / 1e9 for d, s in seconds.items()}


def _split(medians: dict[str, float], impl: str, per: int = 1) -> dict[str, float]:
    return {k.split()[1]: v / per for k, v in medians.items() if k.split()[0] == impl}


def _torch_seconds(case: Case, num_blocks: int, repeat: int) -> dict[str, float]:
    ref = TorchPageMover(case.views, case.layout, num_blocks)
    out = {}
    for d, fn in (
        ("store", lambda: ref.store(case.stores())),
        ("load", lambda: ref.load(case.loads())),
    ):
        fn()
        times = []
        for _ in range(repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[d] = statistics.median(times)
    return out


def measure(
    case: Case, args: argparse.Namespace, arena: HostArena
) -> tuple[list[dict], list[dict]]:
    """One case's rows: per call, and streamed."""
    from kvtier.cuda.platform import CUDAPlatform

    options = {"staging_slot_bytes": args.slot_bytes} if args.slot_bytes else {}
    mover = CUDAPlatform().create_mover(case.views, case.layout, **options)
    check(case, mover, "kvtier")
    stores, loads = case.stores(), case.loads()

    def store() -> None:
        mover.store(stores)

    def load() -> None:
        mover.load(loads)

    limit, release = limit_calls(case.nbytes, arena)
    pairs = [Pair(store, load), Pair(limit["store"], limit["load"])]
    calls: dict[str, Call] = {f"limit {d}": fn for d, fn in limit.items()}
    calls.update({"kvtier store": store, "kvtier load": load, "kvtier both": pairs[0]})
    calls["limit-threads both"] = pairs[1]
    k = args.stream_calls
    streamed = k > 0 and case.shape in args.stream_shapes
    if streamed:
        pairs.append(Pair(repeated(store, k), repeated(load, k)))
        pairs.append(Pair(repeated(limit["store"], k), repeated(limit["load"], k)))
        calls.update({f"limit-streamed {d}": repeated(fn, k) for d, fn in limit.items()})
        calls["kvtier-streamed store"] = repeated(store, k)
        calls["kvtier-streamed load"] = repeated(load, k)
        calls["kvtier-streamed both"] = pairs[2]
        calls["limit-threads-streamed both"] = pairs[3]
    dma = block_dma_calls(case, mover)
    if dma is not None:
        calls.update({f"block-dma {d}": fn for d, fn in dma.items()})
    try:
        medians = interleaved_medians(calls, args.repeat, args.warmup)
    finally:
        for p in pairs:  # before the buffers go: a thread may still be copying
            p.close()
        release()
    limit_gbps = _gbps(case, _split(medians, "limit"))
    rows = _rows(case, "limit", _split(medians, "limit"), limit_gbps)
    rows += _rows(case, "kvtier", _split(medians, "kvtier"), limit_gbps)
    rows += _rows(case, "limit-threads", _split(medians, "limit-threads"), limit_gbps)
    _threaded(rows, "kvtier", "limit-threads")
    if dma is not None:
        rows += _rows(case, "block-dma", _split(medians, "block-dma"), limit_gbps)
    rows += _rows(
        case, "torch", _torch_seconds(case, mover.num_blocks, max(3, args.repeat // 4)), limit_gbps
    )
    srows: list[dict] = []
    if streamed:
        per = _split(medians, "limit-streamed", k)
        sgbps = _gbps(case, per)
        srows = _rows(case, "limit-streamed", per, sgbps)
        srows += _rows(case, "kvtier-streamed", _split(medians, "kvtier-streamed", k), sgbps)
        srows += _rows(
            case, "limit-threads-streamed", _split(medians, "limit-threads-streamed", k), sgbps
        )
        _threaded(srows, "kvtier-streamed", "limit-threads-streamed")
        for r in srows:
            r["calls_per_stream"] = k
    return rows, srows


def target_check(results: list[dict], streamed: list[dict]) -> dict[str, dict]:
    """Issue 36's targets against the worst layout of each shape."""
    out: dict[str, dict] = {}
    for shape, (kind, want) in TARGETS.items():
        impl = "kvtier" if kind == "per_call" else "kvtier-streamed"
        rows = [
            r
            for r in (results if kind == "per_call" else streamed)
            if r["shape"] == shape and r["impl"] == impl and r["direction"] != "both"
        ]
        if rows:
            worst = min(rows, key=lambda r: r["ratio_to_limit"])
            out[f"{shape} {kind}"] = {
                "target": want,
                "worst": worst["ratio_to_limit"],
                "worst_at": f"{worst['layout']} {worst['direction']}",
                "met": worst["ratio_to_limit"] >= want,
            }
    for key, impl, reference, rows in (
        ("both x one-way limit", "kvtier", "limit-threads", results),
        ("streamed both x one-way limit", "kvtier-streamed", "limit-threads-streamed", streamed),
    ):
        both = [r for r in rows if r["impl"] == impl and r["direction"] == "both"]
        if not both:
            continue
        worst = min(both, key=lambda r: r["x_one_direction_limit"])
        plain = [
            r["x_one_direction_limit"]
            for r in rows
            if (r["impl"], r["direction"], r["shape"], r["layout"])
            == (reference, "both", worst["shape"], worst["layout"])
        ]
        out[key] = {
            "target": DUPLEX_TARGET,
            "worst": worst["x_one_direction_limit"],
            "worst_at": f"{worst['shape']} {worst['layout']}",
            "met": worst["x_one_direction_limit"] >= DUPLEX_TARGET,
            # the plain copies through the same two threads, same shape and layout
            "plain_copies_same_threads": plain[0] if plain else None,
        }
    return out


def _plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["results"] + result["streamed"]
    shapes = [s for s in SHAPES if any(r["shape"] == s for r in rows)]
    series = [
        ("kvtier", "store"),
        ("kvtier", "load"),
        ("kvtier", "both"),
        ("kvtier-streamed", "store"),
        ("kvtier-streamed", "load"),
        ("block-dma", "store"),
        ("torch", "store"),
    ]
    fig, axes = plt.subplots(len(shapes), 1, figsize=(11, 3.4 * len(shapes)), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes, strict=True):
        layouts = [
            p for p in LAYOUTS if any(r["layout"] == p and r["shape"] == shape for r in rows)
        ]
        present = [
            (i, d)
            for i, d in series
            if any(r["impl"] == i and r["direction"] == d and r["shape"] == shape for r in rows)
        ]
        width = 0.8 / max(1, len(present))
        for k, (impl, d) in enumerate(present):
            ys = []
            for lay in layouts:
                m = [
                    r
                    for r in rows
                    if (r["shape"], r["layout"], r["impl"], r["direction"]) == (shape, lay, impl, d)
                ]
                ys.append(m[0]["ratio_to_limit"] if m else 0.0)
            ax.bar([g + k * width for g in range(len(layouts))], ys, width, label=f"{impl} {d}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(layouts))])
        ax.set_xticklabels(layouts)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("of the plain pinned copy")
        ax.set_title(f"{shape} shape on {result['device']}", fontsize=9)
        ax.legend(fontsize=7, ncol=4, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvtier bench transfer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=LAYOUTS)
    ap.add_argument("--chunks", type=int, default=16, help="256-token chunks per call (default 16)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stream-calls", type=int, default=8, help="calls per stream (0: none)")
    ap.add_argument("--stream-shapes", nargs="+", choices=sorted(SHAPES), default=["small"])
    ap.add_argument("--slot-bytes", type=int, default=0, help="staging_slot_bytes (0: default)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--device-name", help="name in the output files (default: from the GPU)")
    ap.add_argument("--suffix", default="", help="appended to the output file names")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kvtier bench transfer needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        return 2
    name = torch.cuda.get_device_name()
    slug = args.device_name or device_slug(name)
    arena = bench_arena(args.chunks, args.shapes)
    results: list[dict] = []
    streamed: list[dict] = []
    print(f"device: {name}; {args.chunks} chunks of {CHUNK} tokens a call; median of {args.repeat}")
    print(f"{'shape':<6} {'layout':<6} {'direction':<9} {'impl':<16} {'GB/s':>7} {'ratio':>6}")
    for shape in args.shapes:
        for paged in args.layouts:
            case = make_case(shape, PagedLayout(paged), args.chunks, arena, seed=len(results))
            try:
                rows, srows = measure(case, args, arena)
            finally:
                case.release()
            results += rows
            streamed += srows
            for r in rows + srows:
                extra = (
                    f"  ({r['x_one_direction_limit']}x one-way)"
                    if "x_one_direction_limit" in r
                    else ""
                )
                if "x_threaded_limit" in r:
                    extra += f" ({r['x_threaded_limit']} of limit-threads)"
                print(
                    f"{r['shape']:<6} {r['layout']:<6} {r['direction']:<9} {r['impl']:<16} "
                    f"{r['gbps']:>7.2f} {r['ratio_to_limit']:>6.3f}{extra}"
                )
            del case
            torch.cuda.empty_cache()
    checks = target_check(results, streamed)
    for k, v in checks.items():
        plain = v.get("plain_copies_same_threads")
        print(
            f"target {k}: worst {v['worst']} at {v['worst_at']} (target {v['target']}: "
            f"{'met' if v['met'] else 'NOT met'})"
            + (f"; plain copies there through the same threads: {plain}" if plain else "")
        )
    result = {
        "benchmark": "transfer",
        "device": name,
        "device_slug": slug,
        "torch": torch.__version__,
        "chunks_per_call": args.chunks,
        "chunk_tokens": CHUNK,
        "block_size": BLOCK,
        "dtype": "bfloat16",
        "views": "vLLM 0.32 allocate_kv_cache placement, per layout",
        "staging_slot_bytes": args.slot_bytes or None,
        "timing": (
            "host wall-clock median of whole calls (copies complete on return); every call of a "
            "case once per round in turn; both: a store and a load from two threads at once "
            "(limit-threads: the plain copies from two such threads)"
        ),
        "streamed_timing": f"{args.stream_calls} calls back to back, per call",
        "targets": {
            **{s: {"kind": k, "ratio": v} for s, (k, v) in TARGETS.items()},
            "both_x_one_direction_limit": DUPLEX_TARGET,
        },
        "target_check": checks,
        "verified_against_torch_reference": True,
        "results": results,
        "streamed": streamed,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"transfer-{slug}{'-' + args.suffix if args.suffix else ''}"
    out = args.out / f"{stem}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if _plot(result, args.out / f"{stem}.png"):
        print(f"wrote {args.out / f'{stem}.png'}")
    return 0

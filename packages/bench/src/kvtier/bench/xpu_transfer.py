"""``kvtier bench xpu``: the XPU page mover's store/load throughput per vLLM layout.

Runs on an Intel GPU (``--device xpu``, the default when one exists). Elsewhere it runs the very
same code on ``cuda`` (torch.cuda has the same stream API) or on ``cpu``, which measures the
code path, not Intel hardware. The KV views are placed as vLLM 0.32's ``allocate_kv_cache``
places one cache group's layers (one buffer, the layout's physical order, no padding).
Reference, measured in the same run: one contiguous copy of the same number of bytes between
pinned host memory and the device (the link's limit); each row's ``ratio`` is its throughput
over that reference. Writes ``benchmarks/results/xpu-<device>.json`` (and a PNG when
matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObjMeta
from kvtier.core.platform.mover import Transfer
from kvtier.xpu.mover import XPUPageMover

SHAPES = {
    # (layers, kv heads, head size): an 8B-class model and a small one
    "8b": (32, 8, 128),
    "small": (16, 2, 64),
}


def _default_device() -> str:
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def _best_of(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _drain_op(op: Callable[[list[Transfer]], Iterator[int]], transfers: list[Transfer]) -> None:
    for _ in op(transfers):
        pass


def vllm_placed_views(
    layout: KVLayout, num_blocks: int, device: torch.device
) -> list[torch.Tensor]:
    """Per-layer logical views ``[blocks, H, N, C]`` of one buffer laid out in the layout's
    physical order (vLLM's placement of one cache group without page padding)."""
    cell = layout.cell_bytes // layout.torch_dtype.itemsize
    logical = (layout.num_layers, num_blocks, layout.num_kv_heads, layout.block_size, cell)
    order = layout.paged_layout.stride_order
    buf = torch.randn([logical[d] for d in order], device=device).to(layout.torch_dtype)
    view5 = buf.permute([order.index(d) for d in range(5)])
    return [view5[i] for i in range(layout.num_layers)]


def run_case(
    name: str, paged: PagedLayout, device: torch.device, chunks: int, chunk: int, repeat: int
) -> list[dict]:
    layers, heads, head = SHAPES[name]
    layout = KVLayout(layers, heads, head, "bfloat16", 16, paged)
    tokens = chunks * chunk
    blocks_per_chunk = chunk // layout.block_size
    num_blocks = 2 * tokens // layout.block_size
    caches = vllm_placed_views(layout, num_blocks, device)
    nbytes = layout.chunk_nbytes(tokens)
    pinned = device.type != "cpu"
    arena = HostArena.create(nbytes + 256 * chunks, pin_memory=pinned)  # + alignment slack
    meta = MemoryObjMeta(layout.chunk_shape(chunk), layout.chunk_dtype, chunk)
    objs = [arena.allocate(meta) for _ in range(chunks)]
    # block ids on the host, as the engine's scheduler hands them over
    blocks = torch.randperm(num_blocks)[: chunks * blocks_per_chunk]
    transfers = [
        Transfer(o, blocks[i * blocks_per_chunk : (i + 1) * blocks_per_chunk])  # type: ignore[arg-type]
        for i, o in enumerate(objs)
    ]

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ref_d2h = _best_of(lambda: host.copy_(dev, non_blocking=True), device, repeat)
    ref_h2d = _best_of(lambda: dev.copy_(host, non_blocking=True), device, repeat)

    # staging_buffer only decides whether the buffer outlives a call: one data path to time.
    mover = XPUPageMover(caches, layout, num_blocks)
    cases: dict[str, tuple[Callable[[], object], float]] = {
        "store": (partial(mover.store, transfers), ref_d2h),
        "store_layerwise": (partial(_drain_op, mover.store_layerwise, transfers), ref_d2h),
        "load": (partial(mover.load, transfers), ref_h2d),
        "load_layerwise": (partial(_drain_op, mover.load_layerwise, transfers), ref_h2d),
    }
    rows = []
    for op, (fn, ref) in cases.items():
        t = _best_of(fn, device, repeat)
        rows.append(
            {
                "shape": name,
                "layout": paged.value,
                "op": op,
                "chunks": chunks,
                "chunk_tokens": chunk,
                "bytes": nbytes,
                "seconds": t,
                "gb_per_s": nbytes / t / 1e9,
                "reference_s": ref,
                "reference_gb_per_s": nbytes / ref / 1e9,
                "ratio": ref / t,
            }
        )
    for o in objs:
        o.release()  # type: ignore[union-attr]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench xpu", description=__doc__)
    ap.add_argument("--device", default=_default_device())
    ap.add_argument("--shapes", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    layouts = [p.value for p in PagedLayout]
    ap.add_argument("--layouts", nargs="+", default=layouts, choices=layouts)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)

    rows = []
    print(f"device: {device}  (reference: one contiguous pinned copy of the same bytes)")
    print(
        f"{'shape':>6} {'layout':>6} {'op':>16} {'MiB':>6} {'GB/s':>7} {'ref GB/s':>9} {'ratio':>6}"
    )
    for shape in args.shapes:
        for paged in args.layouts:
            case = run_case(
                shape, PagedLayout(paged), device, args.chunks, args.chunk_size, args.repeat
            )
            for r in case:
                rows.append(r)
                print(
                    f"{r['shape']:>6} {r['layout']:>6} {r['op']:>16} {r['bytes'] / 2**20:>6.0f} "
                    f"{r['gb_per_s']:>7.2f} {r['reference_gb_per_s']:>9.2f} {r['ratio']:>6.2f}"
                )

    name = f"xpu-{device.type}"
    args.out.mkdir(parents=True, exist_ok=True)
    device_name = str(device)
    if device.type != "cpu":
        device_name = getattr(torch, device.type).get_device_name(device)
    result = {
        "benchmark": "xpu page mover",
        "device": device_name,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "reference": "one contiguous pinned host<->device copy of the same bytes",
        "results": rows,
    }
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{name}.png")
    print(f"wrote {args.out / (name + '.json')}")
    return 0


def plot(result: dict, path: Path) -> None:
    """A bar chart of each op's throughput over the reference (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    rows = result["results"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        sub = [r for r in rows if r["shape"] == shape]
        ops = list(dict.fromkeys(r["op"] for r in sub))
        layouts = list(dict.fromkeys(r["layout"] for r in sub))
        width = 0.8 / len(layouts)
        for k, layout in enumerate(layouts):
            vals = [
                next(r["ratio"] for r in sub if r["op"] == op and r["layout"] == layout)
                for op in ops
            ]
            ax.bar([i + width * k for i in range(len(ops))], vals, width=width, label=layout)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ops))], ops, rotation=20)
        ax.set_ylabel("throughput / contiguous copy")
        ax.set_title(f"{shape} on {result['device']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--plot":
        src = Path(sys.argv[2])
        plot(json.loads(src.read_text()), src.with_suffix(".png"))
    else:
        sys.exit(main())

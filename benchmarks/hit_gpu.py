"""Where a host-memory hit's time goes on an NVIDIA GPU, as vLLM's worker spends it (issue 57).

A prompt's chunks are in kvtier's pinned host tier; the hit is then what a worker does for a
load in the step that schedules its request (``scheduler/sync_loads.py``, ``worker/loads.py``):
``hold`` (look the prompt up in the tiers and hold its chunks: what an index-answered load does
first, and what a probe does a step earlier) and ``retrieve`` (plan the pages, copy them into the
paged cache; returns with the copies done), on the thread and stream of the forward pass. The
reference, measured in the same run and interleaved with it: one contiguous pinned host to
device copy of the same bytes (what PCIe can do). ``hit / bytes`` is the done-when's "a
host-memory hit's load within 1.1x of its bytes at the PCIe limit".

Shape: an 8B model (32 layers, 8 KV heads, head 128, bf16, blocks of 16, chunks of 256), in
vLLM's layer-outer layout; prompts of 1024, 4096 and 16384 tokens (64 MiB to 2 GiB of KV).

Usage (GPU machine, torch + triton, no install): ``bash benchmarks/gpu_python.sh
benchmarks/hit_gpu.py --out DIR``. Prints a table and writes ``hit-gpu-<device>.json`` (and a
PNG where matplotlib is installed; ``--plot JSON`` draws one from a JSON elsewhere).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

BLOCK, CHUNK, LAYERS, HEADS, HEAD = 16, 256, 32, 8, 128
PROMPTS = (1024, 4096, 16384)


def _timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def measure(tokens_n: int, rounds: int, profile: bool = False) -> dict:
    from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
    from kvtier.core.platform import get_platform

    platform = get_platform("cuda", device_index=0)
    layout = KVLayout(LAYERS, HEADS, HEAD, "bfloat16", BLOCK, "LBHNC")
    chunk_bytes = layout.chunk_nbytes(CHUNK)
    chunks = tokens_n // CHUNK
    config = load_config(
        env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"], "verify_fraction": 0.0}
    )
    arena = HostArena.create((chunks + 2) * chunk_bytes, pin_memory=True)
    engine = CacheEngine(
        config, layout, model="hit", platform=platform, storage=HostMemoryStorageManager(arena)
    )
    blocks = tokens_n // BLOCK + 1
    caches = [
        torch.randn(layout.expected_cache_shape(blocks), device="cuda").to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    engine.register_kv_caches(caches)
    tokens = torch.arange(7, 7 + tokens_n)
    slots = torch.arange(tokens_n)
    engine.store(tokens, slots)
    torch.cuda.synchronize()
    want = [c.clone() for c in caches]
    nbytes = chunks * chunk_bytes
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    stream = torch.cuda.Stream()  # the forward pass's stream, as in vLLM's worker
    holds, loads, hits, limits = [], [], [], []
    profiler = cProfile.Profile() if profile else None
    for r in range(rounds + 1):
        for c in caches:
            c.zero_()
        sync()
        if profiler is not None and r:
            profiler.enable()
        with torch.cuda.stream(stream):
            t0 = time.perf_counter()
            hold = engine.hold(tokens)
            t1 = time.perf_counter()
            try:
                mask = engine.retrieve(tokens, slots, hold=hold)
            finally:
                hold.release()
            t2 = time.perf_counter()
        sync()
        if profiler is not None:
            profiler.disable()
        limit = _timed(lambda: dev.copy_(host, non_blocking=True), sync)
        if r == 0:  # first round: warm-up, and the bytes checked
            assert bool(mask.all())
            n = tokens_n // BLOCK  # the last block is not the prompt's
            assert all(torch.equal(a[:n], b[:n]) for a, b in zip(caches, want, strict=True))
            continue
        holds.append(t1 - t0)
        loads.append(t2 - t1)
        hits.append(t2 - t0)
        limits.append(limit)
    engine.close()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    med = statistics.median
    return {
        "prompt_tokens": tokens_n,
        "bytes": nbytes,
        "chunks": chunks,
        "hold_s": med(holds),
        "retrieve_s": med(loads),
        "hit_s": med(hits),
        "limit_s": med(limits),
        "limit_gbps": nbytes / med(limits) / 1e9,
        "hit_over_bytes": med(hits) / med(limits),
        "retrieve_over_bytes": med(loads) / med(limits),
        "rounds": rounds,
    }


def plot(report: dict, path: Path) -> None:
    """Each prompt's hold and retrieve as a multiple of its pinned copy's time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [f"{r['prompt_tokens']} tokens\n{r['bytes'] / 2**20:.0f} MiB" for r in rows]
    x = list(range(len(rows)))
    hold = [r["hold_s"] / r["limit_s"] for r in rows]
    retrieve = [r["retrieve_s"] / r["limit_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(x, retrieve, 0.5, label="retrieve (plan + copy)")
    ax.bar(x, hold, 0.5, bottom=retrieve, label="hold (lookup)")
    ax.axhline(1.0, color="black", lw=1, label="pinned copy of the same bytes")
    ax.axhline(1.1, color="red", lw=1, ls="--", label="target 1.1x")
    for i, r in enumerate(rows):
        ax.text(i, r["hit_over_bytes"], f"{r['hit_over_bytes']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(x, labels)
    ax.set_ylabel("time / pinned copy time (medians)")
    ax.set_title(f"a host-memory hit against its bytes at PCIe, {report['device']}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plot", help="draw the PNG of this JSON and exit")
    parser.add_argument(
        "--profile", type=int, help="print where the host time of a hit of this many tokens goes"
    )
    args = parser.parse_args()
    if args.profile:
        measure(args.profile, args.rounds, profile=True)
        return
    if args.plot:
        src = Path(args.plot)
        plot(json.loads(src.read_text()), src.with_suffix(".png"))
        return
    device = torch.cuda.get_device_name()
    rows = [measure(n, args.rounds) for n in PROMPTS]
    print(f"device: {device}")
    print(f"{'tokens':>7} {'MiB':>6} {'hold ms':>8} {'retr ms':>8} {'copy ms':>8} {'hit/bytes':>9}")
    for r in rows:
        print(
            f"{r['prompt_tokens']:>7} {r['bytes'] / 2**20:>6.0f} {r['hold_s'] * 1e3:>8.2f} "
            f"{r['retrieve_s'] * 1e3:>8.2f} {r['limit_s'] * 1e3:>8.2f} {r['hit_over_bytes']:>9.3f}"
        )
    slug = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    out = Path(args.out) / f"hit-gpu-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "torch": torch.__version__, "results": rows}
    out.write_text(json.dumps(report, indent=1) + "\n")
    try:
        plot(report, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no PNG (draw it with --plot)")


if __name__ == "__main__":
    main()

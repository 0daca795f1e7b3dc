"""Saves on another thread must wait for the forward pass that wrote the KV (NVIDIA GPU).

Reproduces vLLM's threading: the main thread runs the "forward pass" on a non-default stream (a
long kernel, then a fill that writes the KV), and hands the save to another thread at once, as
``wait_for_save`` hands it to kvtier's saver thread. Each round writes a new value and stores a
new chunk; the stored bytes must be that round's value. Two variants, measured in one run:

- ``marker``: the save carries ``platform.record_marker()`` taken on the main thread's stream
  (what the vLLM connector does);
- ``no-marker``: the same save without it (the saver thread's stream does not wait).

Usage (GPU machine, torch + triton, no install): ``bash benchmarks/gpu_python.sh
benchmarks/ordering_gpu.py --out DIR``. Prints a table and writes ``ordering-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
from pathlib import Path

import torch

from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
from kvtier.core.platform import get_platform

BLOCK, CHUNK, LAYERS, HEADS, HEAD = 16, 256, 8, 8, 128
SLEEP_CYCLES = 50_000_000  # ~25-35 ms of GPU time before the KV is written


def run_rounds(rounds: int, use_marker: bool) -> dict:
    platform = get_platform("cuda", device_index=0)
    layout = KVLayout(LAYERS, HEADS, HEAD, "bfloat16", BLOCK, "LBHNC")
    config = load_config(env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"]})
    arena = HostArena.create(
        (rounds + 2) * math.prod(layout.chunk_shape(CHUNK)) * 2, pin_memory=True
    )
    engine = CacheEngine(
        config, layout, model="ordering", platform=platform, storage=HostMemoryStorageManager(arena)
    )
    caches = [
        torch.zeros(
            layout.expected_cache_shape(CHUNK // BLOCK), dtype=torch.bfloat16, device="cuda"
        )
        for _ in range(LAYERS)
    ]
    engine.register_kv_caches(caches)
    compute = torch.cuda.Stream()
    slots = torch.arange(CHUNK)
    stale = 0
    for r in range(1, rounds + 1):
        tokens = torch.full((CHUNK,), r, dtype=torch.int64)
        with torch.cuda.stream(compute):
            torch.cuda._sleep(SLEEP_CYCLES)
            for cache in caches:
                cache.fill_(float(r))
            marker = platform.record_marker() if use_marker else None
        saver = threading.Thread(
            target=engine.store, args=(tokens, slots), kwargs={"ready": marker}
        )
        saver.start()
        saver.join()
        torch.cuda.synchronize()
        obj = engine.storage.get(engine.store_spans(tokens)[0].key)
        assert obj is not None
        with obj:
            ok = bool((obj.tensor == float(r)).all())
        stale += not ok
    engine.close()
    return {
        "variant": "marker" if use_marker else "no-marker",
        "rounds": rounds,
        "stale_rounds": stale,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    rows = [run_rounds(args.rounds, True), run_rounds(args.rounds, False)]
    print(f"device: {device}")
    print(f"{'variant':<10} {'rounds':>6} {'stale':>6}")
    for row in rows:
        print(f"{row['variant']:<10} {row['rounds']:>6} {row['stale_rounds']:>6}")
    slug = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    out = Path(args.out) / f"ordering-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

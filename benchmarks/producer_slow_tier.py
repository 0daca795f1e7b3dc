"""A prefill producer's store time with a lower tier that sleeps, against one that does not.

A ``kv_producer`` keeps chunks that find the lower-tier write queue full waiting in the queue for
up to ``write_queue_wait_s`` (10 s) instead of dropping them. The store (what the worker's saver
thread runs, and what block frees and save reports wait for) must not wait with them. Both runs
use the same engine shape (CPU platform, host memory + disk, a write queue of 2, one writer); in
the slow one every disk write sleeps ``--sleep-s``. Reports the median ``engine.store`` time of
4 chunks over ``--rounds`` prompts, and the ratio slow / fast (1.0 is the goal).

    python benchmarks/producer_slow_tier.py [--rounds 20] [--sleep-s 0.5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvtier.core import CacheEngine, HostArena, KVLayout, load_config
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.storage.backends.base import BackendContext
from kvtier.storage.backends.disk.local_disk import LocalDiskBackend
from kvtier.storage.backends.local_cpu import LocalCPUBackend
from kvtier.storage.manager import TieredStorageManager
from kvtier.storage.stats import StorageStats

CHUNK, BLOCK, CHUNKS = 256, 32, 4
LAYOUT = KVLayout(
    num_layers=8,
    num_kv_heads=4,
    head_size=64,
    dtype="bfloat16",
    block_size=BLOCK,
    paged_layout="LBHNC",
)


def engine(root: Path, sleep_s: float) -> CacheEngine:
    class SleepyDisk(LocalDiskBackend):
        def batched_put(self, items):  # type: ignore[no-untyped-def]
            time.sleep(sleep_s)
            super().batched_put(items)

    cfg = load_config(
        env={},
        overrides={
            "chunk_size": CHUNK,
            "tiers": ["local_cpu", "local_disk"],
            "local_cpu_size_gb": 1.0,
            "local_disk_path": str(root / "disk"),
            "write_queue_size": 2,
            "write_queue_wait_s": 10.0,
            "io_threads": 1,
        },
    )
    arena = HostArena.create(1 << 30)
    stats = StorageStats()
    ns = "bench"
    tiers = [
        cls(BackendContext(config=cfg, layout=LAYOUT, namespace=ns, arena=arena, stats=stats))
        for cls in (LocalCPUBackend, SleepyDisk)
    ]
    storage = TieredStorageManager(
        tiers,
        arena=arena,
        stats=stats,
        write_queue_size=cfg.write_queue_size,
        io_threads=cfg.io_threads,
        close_timeout_s=1.0,
        write_queue_wait_s=cfg.write_queue_wait_s,
    )
    eng = CacheEngine(cfg, LAYOUT, model="m", platform=CPUPlatform(), storage=storage)
    blocks = CHUNKS * CHUNK // BLOCK + 1
    eng.register_kv_caches(
        [torch.randn(LAYOUT.expected_cache_shape(blocks)).to(torch.bfloat16) for _ in range(8)]
    )
    return eng


def store_times(eng: CacheEngine, rounds: int) -> list[float]:
    n = CHUNKS * CHUNK
    out = []
    for r in range(rounds):
        tokens = np.arange(r * n, (r + 1) * n) % 30000 + r
        t0 = time.perf_counter()
        eng.store(tokens, torch.arange(n))
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--sleep-s", type=float, default=0.5)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rows = {}
    for name, sleep_s in (("fast lower tier", 0.0), ("sleeping lower tier", args.sleep_s)):
        with tempfile.TemporaryDirectory() as tmp:
            eng = engine(Path(tmp), sleep_s)
            times = store_times(eng, args.rounds)
            dropped = eng.storage.stats.get("write_queue.dropped")
            eng.close()
        rows[name] = {
            "median_store_s": round(statistics.median(times), 5),
            "max_store_s": round(max(times), 5),
            "lower_tier_dropped": dropped,
        }
        print(
            f"{name:22s} median {rows[name]['median_store_s']:.4f} s  max "
            f"{rows[name]['max_store_s']:.4f} s  dropped {dropped}"
        )
    ratio = (
        rows["sleeping lower tier"]["median_store_s"] / rows["fast lower tier"]["median_store_s"]
    )
    print(f"ratio (sleeping / fast, median): {ratio:.2f}")
    result = {
        "rounds": args.rounds,
        "sleep_s": args.sleep_s,
        "runs": rows,
        "ratio": round(ratio, 2),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "producer-slow-tier.json").write_text(json.dumps(result, indent=2) + "\n")
    _chart(rows, out / "producer-slow-tier.png")


def _chart(rows: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, [rows[n]["median_store_s"] * 1000 for n in names])
    ax.set_ylabel("median engine.store of 4 chunks (ms)")
    ax.set_title("producer store time, lower tier sleeping or not")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

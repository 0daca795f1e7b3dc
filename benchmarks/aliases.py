"""What alias entries (block-granular hits inside stored chunks, ``kvtier.core.keys.aliases``) cost.

For two KV shapes (the vLLM CPU test model, and an 8B-class model) and two tier sets (host
memory only; host memory + disk, flushed), stores the same prompts with aliases on and off in
interleaved rounds and reports: store time per chunk (store + flush), bytes on disk, entries
written, and the lookup time of a prompt that diverges inside a stored chunk. Ratios are
on/off from the same run.

    python benchmarks/aliases.py [--rounds 5] [--out benchmarks/results/aliases]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvtier.core import CacheEngine, KVLayout, load_config
from kvtier.core.layout import PagedLayout
from kvtier.core.platform.cpu import CPUPlatform

SHAPES = {
    # name: (layout, chunk, chunks per prompt, prompts)
    "cpu-test-model": (KVLayout(4, 2, 64, "bfloat16", 32, PagedLayout.LBHNC), 256, 4, 6),
    "8b": (KVLayout(32, 8, 128, "bfloat16", 16, PagedLayout.LBHNC), 256, 2, 3),
}
TIERS = {"host": ["local_cpu"], "host+disk": ["local_cpu", "local_disk"]}


def make_engine(layout: KVLayout, chunk: int, tiers: list[str], disk: Path, tokens: int):
    config = load_config(
        env={},
        overrides={
            "chunk_size": chunk,
            "tiers": tiers,
            "local_cpu_size_gb": 2.0,
            "local_disk_path": str(disk),
            "local_disk_size_gb": 8.0,
        },
    )
    engine = CacheEngine(config, layout, model="bench/model", platform=CPUPlatform())
    blocks = tokens // layout.block_size + 1
    g = torch.Generator().manual_seed(0)
    shape = layout.expected_cache_shape(blocks)
    engine.register_kv_caches(
        [torch.randn(shape, generator=g).to(layout.torch_dtype) for _ in range(layout.num_layers)]
    )
    return engine


def one_round(name: str, tiers: str, aliases: bool, seed: int) -> dict[str, float]:
    layout, chunk, per_prompt, prompts = SHAPES[name]
    tokens = chunk * per_prompt
    with tempfile.TemporaryDirectory(dir=Path.home()) as d:
        engine = make_engine(layout, chunk, TIERS[tiers], Path(d), tokens)
        engine.spans.write_aliases = aliases
        slots = torch.arange(tokens)
        base = 1000 + seed * 100_000
        docs = [list(range(base + p * tokens, base + (p + 1) * tokens)) for p in range(prompts)]
        t0 = time.perf_counter()
        for doc in docs:
            engine.store(doc, slots)
        assert engine.storage.flush(600)
        store_s = time.perf_counter() - t0
        disk = sum(f.stat().st_size for f in Path(d).rglob("*.kvc"))
        entries = len(list(Path(d).rglob("*.kvc"))) if tiers != "host" else 0
        # a prompt diverging three blocks into each document's last chunk
        at = tokens - chunk + 3 * layout.block_size
        t0 = time.perf_counter()
        hits = [engine.lookup(doc[:at] + [7] * chunk) for doc in docs]
        lookup_s = (time.perf_counter() - t0) / len(docs)
        engine.close()
    return {
        "store_s_per_chunk": store_s / (prompts * per_prompt),
        "disk_bytes": disk,
        "disk_entries": entries,
        "lookup_ms": 1e3 * lookup_s,
        "hit": statistics.mean(hits),
        "at": at,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/aliases")
    args = ap.parse_args()
    rows = []
    for name in SHAPES:
        for tiers in TIERS:
            runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
            for r in range(args.rounds):
                for aliases in (r % 2 == 0, r % 2 != 0):  # interleaved, order alternating
                    runs[aliases].append(one_round(name, tiers, aliases, r))
            med = {
                a: {k: statistics.median(x[k] for x in v) for k in v[0]} for a, v in runs.items()
            }
            row = {
                "shape": name,
                "tiers": tiers,
                "store_ms_per_chunk_on": 1e3 * med[True]["store_s_per_chunk"],
                "store_ms_per_chunk_off": 1e3 * med[False]["store_s_per_chunk"],
                "store_ratio": med[True]["store_s_per_chunk"] / med[False]["store_s_per_chunk"],
                "disk_bytes_on": med[True]["disk_bytes"],
                "disk_bytes_off": med[False]["disk_bytes"],
                "disk_entries_on": med[True]["disk_entries"],
                "disk_entries_off": med[False]["disk_entries"],
                "lookup_ms_on": med[True]["lookup_ms"],
                "lookup_ms_off": med[False]["lookup_ms"],
                "hit_on": med[True]["hit"],
                "hit_off": med[False]["hit"],
                "diverge_at": med[True]["at"],
            }
            rows.append(row)
            print(
                f"{name:<16} {tiers:<10} store/chunk {row['store_ms_per_chunk_on']:8.2f} ms on "
                f"{row['store_ms_per_chunk_off']:8.2f} ms off ({row['store_ratio']:.3f}x)  "
                f"disk {row['disk_bytes_on']:.0f} / {row['disk_bytes_off']:.0f} B  "
                f"lookup {row['lookup_ms_on']:.2f} / {row['lookup_ms_off']:.2f} ms  "
                f"hit {row['hit_on']:.0f} / {row['hit_off']:.0f} (diverging at {row['diverge_at']:.0f})"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "aliases.json").write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r['shape']}\n{r['tiers']}" for r in rows]
        ax.bar(labels, [r["store_ratio"] for r in rows])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel("store time per chunk, aliases on / off")
        ax.set_title("Alias entries: store cost (same run, interleaved rounds)")
        fig.tight_layout()
        fig.savefig(out / "aliases.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no chart")


if __name__ == "__main__":
    main()

"""``kvtier bench hashing``: prefix-chained chunk hashing of a long prompt.

Reference, measured in the same run: one blake2b call over the same token bytes (the cost of
hashing the bytes at all). The ratio says what the chaining and per-chunk work cost on top.
Writes ``benchmarks/results/hashing.json`` (and a PNG when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import time
from pathlib import Path

import numpy as np

from kvtier.core.keys import prefix_hashes, token_bytes


def _best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench hashing", description=__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    rows = []
    print(f"{'tokens':>8} {'kvtier ms':>10} {'blake2b ms':>11} {'ratio':>6} {'Mtok/s':>8}")
    for n in args.tokens:
        tokens = rng.integers(0, 128_000, size=n, dtype=np.int64)
        raw = token_bytes(tokens).tobytes()
        t_kv = _best_of(lambda t=tokens: prefix_hashes(t, args.chunk_size), args.repeat)
        t_ref = _best_of(lambda r=raw: hashlib.blake2b(r, digest_size=16).digest(), args.repeat)
        row = {
            "tokens": n,
            "chunk_size": args.chunk_size,
            "kvtier_s": t_kv,
            "reference_s": t_ref,
            "ratio": t_ref / t_kv,
            "mtokens_per_s": n / t_kv / 1e6,
        }
        rows.append(row)
        print(
            f"{n:>8} {t_kv * 1e3:>10.3f} {t_ref * 1e3:>11.3f} {row['ratio']:>6.2f} "
            f"{row['mtokens_per_s']:>8.1f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "hashing",
        "machine": platform.machine(),
        "processor": platform.processor(),
        "reference": "one blake2b call over the same token bytes",
        "results": rows,
    }
    (args.out / "hashing.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
    else:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [r["tokens"] for r in rows]
        ax.plot(xs, [r["kvtier_s"] * 1e3 for r in rows], "o-", label="kvtier prefix hashes")
        ax.plot(xs, [r["reference_s"] * 1e3 for r in rows], "s--", label="one blake2b call")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms")
        ax.set_title(f"chunk hashing (chunk {args.chunk_size})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "hashing.png", dpi=120)
    print(f"wrote {args.out / 'hashing.json'}")
    return 0

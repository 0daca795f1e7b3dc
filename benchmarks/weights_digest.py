"""What naming the weights by their content costs at start (``kvtier.vllm_integration.weights``).

Writes a checkpoint of ``--gb`` GB (safetensors files of 4 GB at most, random bytes) into a temp
dir and times: the first digest of its files (every byte read, pieces hashed on every core), the
digest at the next start (the per-file-version cache: stat only), and the live-parameter digest
of ``--live-gb`` GB of bf16 tensors in memory (word sums and samples). The reference is the
time to read the same files once with ``cat > /dev/null`` (what any loader pays at least).

    python benchmarks/weights_digest.py [--gb 16] [--live-gb 4] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kvtier.vllm_integration import weights
from kvtier.vllm_integration.weights import digest_tensors, files_digest, weight_files

FILE_GB = 4


def write_checkpoint(root: Path, gb: float) -> list[Path]:
    block = os.urandom(64 << 20)
    left = int(gb * (1 << 30))
    files = []
    i = 0
    while left > 0:
        size = min(left, FILE_GB << 30)
        path = root / f"model-{i:05d}.safetensors"
        with open(path, "wb") as f:
            written = 0
            while written < size:
                n = min(len(block), size - written)
                f.write(block[:n])
                written += n
        files.append(path)
        left -= size
        i += 1
    return files


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=16.0)
    ap.add_argument("--live-gb", type=float, default=4.0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        root = Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(root / "cache")
        ckpt = root / "ckpt"
        ckpt.mkdir()
        print(f"writing a {args.gb:g} GB checkpoint ...", flush=True)
        write_checkpoint(ckpt, args.gb)
        files = weight_files(str(ckpt))
        read_s, _ = timed(
            lambda: subprocess.run(
                ["sh", "-c", f"cat {ckpt}/*.safetensors > /dev/null"], check=True
            )
        )
        first_s, digest = timed(lambda: files_digest(files))
        weights._DIGESTS.clear()  # what a restart has: the digests on disk only
        again_s, again = timed(lambda: files_digest(files))
        assert again == digest
    n = int(args.live_gb * (1 << 30)) // 2
    per = 1 << 26  # 64 Mi elements (128 MiB) per tensor
    tensors = [
        (f"layer.{i}.weight", torch.empty(min(per, n - i * per), dtype=torch.bfloat16).normal_())
        for i in range(-(-n // per))
    ]
    live_s, _ = timed(lambda: digest_tensors(tensors))
    rows = {
        "checkpoint_gb": args.gb,
        "files": len(files),
        "read_once_s (cat, reference)": round(read_s, 2),
        "first_digest_s": round(first_s, 2),
        "first_digest_vs_read": round(first_s / read_s, 2),
        "next_start_digest_s": round(again_s, 4),
        "live_gb": args.live_gb,
        "live_digest_s": round(live_s, 2),
        "live_gb_per_s": round(args.live_gb / live_s, 2),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
    }
    for k, v in rows.items():
        print(f"{k:32s} {v}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weights-digest.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""What a node-tier hit costs next to a same-process host-memory hit (issue 55).

For each chunk size: chunks stored in the node tier (``/dev/shm``, another process's files as far
as the reader knows: a fresh backend reads them), then loaded into a paged-cache-like tensor
(``copy_`` into a preallocated destination, the CPU platform's load). Two loads of the same bytes:

- ``host``: the chunk already in this process's host memory (a ``local_cpu`` hit): one copy;
- ``node first``: a reader that never read these files (another process's first hit): each
  file mapped, its checksum checked over the mapping, then the same copy from the mapping;
- ``node again``: the same reader again (its mappings are kept): the copy from the mapping.

``--root`` puts the node tier elsewhere (a tmpfs mounted ``huge=within_size``, where the first
hit faults 2 MiB pages instead of 4 KiB ones); ``--tag`` names the result file.

Reference in the same run: ``host``. Reported: bytes per second of each, and node / host.

    python benchmarks/node_tier.py [--sizes-mib 2,8,32] [--chunks 16] [--repeat 5]
        [--root DIR] [--tag NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

from kvtier.core.config import load_config
from kvtier.core.keys import KeyFactory
from kvtier.core.layout import KVLayout
from kvtier.core.memory import HostArena, MemoryObjMeta
from kvtier.storage.backends.base import BackendContext
from kvtier.storage.backends.node import file_system_of
from kvtier.storage.stats import StorageStats
from kvtier.storage.tiers import load_backend_class

MiB = 1 << 20


def mount_options(path: Path) -> str:
    """The mount options of the file system ``path`` is on (``huge=`` shows there)."""
    best, opts = -1, ""
    target = os.path.realpath(path)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        mp = f[4]
        if (target == mp or target.startswith(mp.rstrip("/") + "/")) and len(mp) >= best:
            best, opts = len(mp), f[f.index("-") + 3]
    return opts


def layout_for(mib: int) -> tuple[KVLayout, int]:
    """A layout whose 256-token chunk is ``mib`` MiB, and that chunk size."""
    heads = max(1, mib * MiB // (256 * 2 * 128 * 2 * 8))
    layout = KVLayout(
        num_layers=8,
        num_kv_heads=heads,
        head_size=128,
        dtype="bfloat16",
        block_size=16,
        paged_layout="LBHNC",
    )
    return layout, 256


def measure(mib: int, chunks: int, repeat: int, root: Path) -> dict:
    layout, tokens = layout_for(mib)
    meta = MemoryObjMeta(layout.chunk_shape(tokens), layout.chunk_dtype, tokens)
    arena = HostArena.create((2 * chunks + 2) * meta.nbytes + (64 << 20))
    cfg = load_config(
        overrides={
            "tiers": ["local_cpu", "node"],
            "node_path": str(root),
            "node_size_gb": 2 * chunks * meta.nbytes / (1 << 30) + 1,
            "chunk_size": tokens,
        },
        env={},
    )
    keys = KeyFactory("bench", layout.fingerprint())

    def backend():  # type: ignore[no-untyped-def]
        ctx = BackendContext(
            config=cfg,
            layout=layout,
            namespace=keys.key(b"").namespace(),
            arena=arena,
            stats=StorageStats(),
            options={},
        )
        return load_backend_class("node", cfg.plugins)(ctx)

    writer = backend()
    ks = [keys.key(i.to_bytes(16, "little")) for i in range(chunks)]
    host = []
    for k in ks:
        obj = arena.allocate(meta)
        assert obj is not None
        obj.tensor.view(torch.uint8).random_(0, 255)
        writer.batched_put([(k, obj)])
        host.append(obj)  # the same chunks, held in this process's host memory
    writer.close()
    dest = torch.empty((chunks, *meta.shape), dtype=meta.dtype)

    def load(reader) -> float:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        got = reader.batched_get(ks, arena.allocate)
        for i, obj in enumerate(got):
            assert obj is not None, "a node-tier chunk missed"
            dest[i].copy_(obj.tensor)
            obj.release()
        return time.perf_counter() - t0

    host_s, first_s, again_s = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for i, obj in enumerate(host):
            dest[i].copy_(obj.tensor)
        host_s.append(time.perf_counter() - t0)
        reader = backend()  # a process that never read these chunks
        first_s.append(load(reader))
        again_s.append(load(reader))  # the same process again: its mappings are kept
        reader.close()
    for obj in host:
        obj.release()
    total = chunks * meta.nbytes
    host_bps = total / statistics.median(host_s)
    first_bps = total / statistics.median(first_s)
    again_bps = total / statistics.median(again_s)
    return {
        "chunk_mib": round(meta.nbytes / MiB, 2),
        "chunks": chunks,
        "host_gbps": host_bps / 1e9,
        "node_first_gbps": first_bps / 1e9,
        "node_again_gbps": again_bps / 1e9,
        "first_over_host": first_bps / host_bps,
        "again_over_host": again_bps / host_bps,
    }


def measure_engine(chunks: int, repeat: int, root: Path) -> dict:
    """Through ``CacheEngine``, as vLLM's worker calls it: ``hold`` (a probe's lookup: a node hit
    is mapped and checked there) then ``retrieve`` (the load into a paged KV cache). Engine A
    stored the prompt (its host tier holds it: the reference); engine B, started after, reads
    it from the node tier: first with no mapping, then again."""
    from kvtier.core.engine import CacheEngine
    from kvtier.core.platform.cpu import CPUPlatform

    layout = KVLayout(8, 8, 128, "bfloat16", 16, paged_layout="LBHNC")  # 8 MiB 256-token chunks
    tokens = 256
    n = chunks * tokens
    cfg = load_config(
        overrides={
            "tiers": ["local_cpu", "node"],
            "node_path": str(root),
            "node_size_gb": 2 * chunks * 8 / 1024 + 1,
            "local_cpu_size_gb": chunks * 8 / 1024 + 0.25,
            "chunk_size": tokens,
            "verify_fraction": 0.0,
        },
        env={},
    )
    prompt = torch.arange(10_000, 10_000 + n + 1)  # the last token is never stored

    def engine() -> CacheEngine:
        e = CacheEngine(cfg, layout, model="bench", platform=CPUPlatform())
        shape = layout.expected_cache_shape(n // 16 + 1)
        e.register_kv_caches([torch.zeros(shape, dtype=torch.bfloat16) for _ in range(8)])
        return e

    a = engine()
    assert a.store(prompt.numpy(), torch.arange(n + 1)) == n
    assert a.storage.flush(120.0), "the node tier did not take every chunk"

    def load(e: CacheEngine) -> tuple[float, float]:
        t0 = time.perf_counter()
        hold = e.hold(prompt.numpy())
        t1 = time.perf_counter()
        assert hold.num_tokens == n, f"a hit of {hold.num_tokens} of {n} tokens"
        mask = e.retrieve(prompt.numpy(), torch.arange(n + 1), hold=hold)
        t2 = time.perf_counter()
        hold.release()
        assert int(mask.sum()) == n
        return t1 - t0, t2 - t1

    host, first, again = [], [], []
    for _ in range(repeat):
        host.append(load(a))
        b = engine()
        first.append(load(b))
        again.append(load(b))
        b.close()
    a.close()

    def med(xs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(x[i] for x in xs)

    out: dict = {"chunk_mib": 8.0, "chunks": chunks}
    for name, xs in (("host", host), ("node_first", first), ("node_again", again)):
        out[f"{name}_hold_ms"] = med(xs, 0) * 1e3
        out[f"{name}_load_ms"] = med(xs, 1) * 1e3
    for name in ("node_first", "node_again"):
        out[f"{name}_load_over_host"] = out["host_load_ms"] / out[f"{name}_load_ms"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default="2,8,32")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--root", default="/dev/shm", help="a memory file system's directory")
    p.add_argument("--tag", default="", help="suffix of the result files' names")
    args = p.parse_args()
    root = Path(args.root) / f"kvtier-bench-{os.getuid()}-{uuid.uuid4().hex[:8]}"
    rows = []
    try:
        for mib in [int(s) for s in args.sizes_mib.split(",")]:
            rows.append(measure(mib, args.chunks, args.repeat, root))
            r = rows[-1]
            print(
                f"{r['chunk_mib']:8.2f} MiB  host {r['host_gbps']:6.2f} GB/s  "
                f"node first {r['node_first_gbps']:6.2f} GB/s ({r['first_over_host']:.2f})  "
                f"again {r['node_again_gbps']:6.2f} GB/s ({r['again_over_host']:.2f})",
                flush=True,
            )
        engine_row = measure_engine(args.chunks, args.repeat, root)
        e = engine_row
        print(
            "through the engine (8 MiB chunks): hold / load ms: "
            f"host {e['host_hold_ms']:.1f} / {e['host_load_ms']:.1f}, "
            f"node first {e['node_first_hold_ms']:.1f} / {e['node_first_load_ms']:.1f} "
            f"(load {e['node_first_load_over_host']:.2f} of host), "
            f"again {e['node_again_hold_ms']:.1f} / {e['node_again_load_ms']:.1f} "
            f"({e['node_again_load_over_host']:.2f})",
            flush=True,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "node_tier",
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "node_path_fs": f"{args.root}: {file_system_of(root)} ({mount_options(root)})",
        "reference": "a same-process host-memory hit of the same chunks (one copy_)",
        "results": rows,
        "engine": engine_row,
    }
    name = f"node-tier{'-' + args.tag if args.tag else ''}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return 0
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.27 for i in x], [r["host_gbps"] for r in rows], 0.27, label="host-memory hit")
    ax.bar([i for i in x], [r["node_first_gbps"] for r in rows], 0.27, label="node, first hit")
    ax.bar([i + 0.27 for i in x], [r["node_again_gbps"] for r in rows], 0.27, label="node, again")
    ax.set_xticks(list(x), [f"{r['chunk_mib']:.0f} MiB" for r in rows])
    ax.set_ylabel("load GB/s")
    ax.set_title("Loading a chunk into the KV cache (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    print(f"wrote {out / name}.json and {out / name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

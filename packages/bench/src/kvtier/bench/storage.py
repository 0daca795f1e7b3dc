"""Storage-tier benchmark: ``kvtier bench storage``.

For each tier (``local_cpu``, ``local_disk``, ``redis``), each chunk shape (an 8B-shaped model:
32 layers, 8 kv heads, head 128, bf16, 256 tokens = 32 MiB per chunk; a small model: 16 layers,
2 kv heads, head 64 = 2 MiB) and each op (``put``, ``get``) it measures kvtier's throughput
next to a reference over the same bytes, measured in the same run and interleaved with it:

- local_cpu: put = allocate + copy the chunk in + ``StorageManager.put``; get =
  ``StorageManager.get`` + copy the chunk out. Reference: one memcpy (``Tensor.copy_``).
- local_disk: the tier's ``batched_put`` (header, checksum, write, fsync, rename) and
  ``batched_get`` (open, header checks, read into the arena, checksum). Reference: raw
  ``write`` + ``fsync`` of the same bytes, and raw ``read`` into a preallocated buffer. Reads
  are measured twice: from the page cache (``variant: page-cache``) and from the device, the
  files evicted from the cache with ``posix_fadvise(DONTNEED)`` first (``variant:
  from-device``), on both sides. With ``cryptography`` installed, put and page-cache get are
  measured again with ``encryption_key`` set (``variant: sealed``, ``page-cache sealed``): the
  cost of encryption at rest against the same raw I/O.
- redis: the tier's ``batched_put``/``batched_get`` (codec included) against ``redis-benchmark``
  (the C client) moving values of the tier's segment size over as many connections, and a
  3-shard cluster against one server, and with ``encryption_key`` against without (``variant:
  sealed``): see ``kvtier.bench.storage_redis``. Private
  ``redis-server`` processes are started on free loopback ports; without ``redis-server`` the
  redis rows are skipped.

Host arenas are touched before timing (a serving engine's arena is, after its first minutes;
otherwise the first write to each page would be timed as a page fault on our side only).

Writes ``<out>/storage.json`` (rows of ``tier, shape, op, gbps, reference_gbps, ratio``) and
``<out>/storage.png``. GB/s are 1e9 bytes per second; each figure is the median of ``--repeat``
rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.storage_common import SHAPES, Bench, Shape, chart, make_backend, touched_arena
from kvtier.bench.storage_disk import bench_disk
from kvtier.core.keys import KeyFactory
from kvtier.storage.backends.local_cpu import LocalCPUBackend
from kvtier.storage.manager import TieredStorageManager

__all__ = ["SHAPES", "Shape", "bench_cpu", "bench_disk", "main"]


def bench_cpu(b: Bench, shape: Shape) -> None:
    meta = shape.meta
    arena = touched_arena(meta.nbytes * (2 * shape.batch + 2))
    keys = KeyFactory("bench", shape.layout.fingerprint())
    host = make_backend(LocalCPUBackend, shape, arena, tiers=["local_cpu"])
    m = TieredStorageManager([host], arena=arena, stats=host.ctx.stats)
    src = [torch.empty(meta.shape, dtype=meta.dtype) for _ in range(shape.batch)]
    dst = [torch.empty(meta.shape, dtype=meta.dtype) for _ in range(shape.batch)]
    for i, t in enumerate(src):
        t.view(torch.int16).random_(-30000, 30000, generator=torch.Generator().manual_seed(i))
    nbytes = meta.nbytes * shape.batch

    def k(r: int, i: int):
        return keys.key(r.to_bytes(4, "little") + i.to_bytes(4, "little"))

    def memcpy(r: int) -> Callable[[], None]:
        def run() -> None:
            for s, d in zip(src, dst, strict=True):
                d.copy_(s)

        return run

    def put(r: int) -> Callable[[], None]:
        def run() -> None:
            for i, s in enumerate(src):
                obj = m.allocate(meta)
                assert obj is not None
                with obj:
                    obj.tensor.copy_(s)
                    m.put(k(r, i), obj)

        return run

    def get(r: int) -> Callable[[], None]:
        put(r)()

        def run() -> None:
            for i, d in enumerate(dst):
                obj = m.get(k(r, i))
                assert obj is not None
                with obj:
                    d.copy_(obj.tensor)

        return run

    try:
        b.compare("local_cpu", shape, "put", nbytes, put, memcpy)
        b.compare("local_cpu", shape, "get", nbytes, get, memcpy)
    finally:
        m.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvtier bench storage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="a small run: 2 rounds, batches halved")
    ap.add_argument("--repeat", type=int, default=15, help="timed rounds per figure (median)")
    ap.add_argument(
        "--tiers",
        nargs="+",
        default=["local_cpu", "local_disk", "redis"],
        choices=["local_cpu", "local_disk", "redis"],
    )
    ap.add_argument(
        "--shapes", nargs="+", default=[s.name for s in SHAPES], choices=[s.name for s in SHAPES]
    )
    ap.add_argument(
        "--disk-dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the disk tier and the raw reference files are written",
    )
    ap.add_argument(
        "--no-redis-cluster", action="store_true", help="skip the 3-shard Redis Cluster row"
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of the tiers not run from <out>/storage.json (listed in "
        "its 'merged_tiers': they come from an earlier run)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    repeat = 2 if args.quick else args.repeat
    shapes = [s for s in SHAPES if s.name in args.shapes]
    if args.quick:
        shapes = [Shape(s.name, s.layout, s.tokens, max(1, s.batch // 2)) for s in shapes]
    b = Bench(repeat)
    load_start = os.getloadavg()[0]  # a shared machine's load moves every figure: record it
    server = cluster = None
    redis_note = None
    if "redis" in args.tiers:
        from kvtier.bench import storage_redis as bench_redis

        try:
            server, cluster = bench_redis.start_servers(not args.no_redis_cluster)
            redis_note = server.version()
        except (FileNotFoundError, RuntimeError) as e:
            redis_note = f"skipped: {e}"
            print(f"redis rows skipped: {e}", file=sys.stderr)
    print(f"{'tier':<11}{'shape':<7}{'op':<16}{'GB/s':>9}{'ref GB/s':>11}{'ratio':>8}{'target':>8}")
    try:
        for shape in shapes:
            if "local_cpu" in args.tiers:
                bench_cpu(b, shape)
            if "local_disk" in args.tiers:
                bench_disk(b, shape, args.disk_dir)
                if importlib.util.find_spec("cryptography") is not None:
                    bench_disk(b, shape, args.disk_dir, sealed=True)
            if server is not None:
                bench_redis.bench_redis(b, shape, server, cluster)
    finally:
        for s in (server, cluster):
            if s is not None:
                s.close()
    args.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": "storage",
        "machine": {
            "system": platform.platform(),
            "processor": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "redis_server": redis_note,
            "torch_threads": torch.get_num_threads(),
            "load_average_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        },
        "params": {
            "repeat": repeat,
            "quick": args.quick,
            "shapes": {
                s.name: {
                    "chunk_bytes": s.meta.nbytes,
                    "batch": s.batch,
                    "layers": s.layout.num_layers,
                    "kv_heads": s.layout.num_kv_heads,
                    "head_size": s.layout.head_size,
                    "tokens": s.tokens,
                }
                for s in shapes
            },
        },
        "reference": {
            "local_cpu": "memcpy (Tensor.copy_) of the same bytes",
            "local_disk": "raw write+fsync / read of the same bytes; reads both from the "
            "page cache and from the device (cache dropped with fadvise)",
            "redis": "redis-benchmark SET/GET of values of the tier's segment size over "
            "the tier's connection count (each row's command in 'reference'); "
            "the cluster-3 row: the tier reading from one server",
        },
        "results": b.rows,
    }
    old_path = args.out / "storage.json"
    if args.merge and old_path.exists():
        old = json.loads(old_path.read_text())
        kept: list[dict[str, Any]] = [
            r for r in old.get("results", []) if r.get("tier") not in args.tiers
        ]
        b.rows = kept + b.rows
        doc["results"] = b.rows
        doc["merged_tiers"] = sorted({r["tier"] for r in kept})
        if "redis" not in args.tiers:  # the kept redis rows' server
            doc["machine"]["redis_server"] = old.get("machine", {}).get("redis_server")
    (args.out / "storage.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out / 'storage.json'}")
    if b.rows:
        chart(b.rows, args.out / "storage.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

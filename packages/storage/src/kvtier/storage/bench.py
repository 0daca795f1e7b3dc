"""Storage-tier benchmark: ``kvtier bench storage`` (or ``python benchmarks/storage.py``).

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
  3-shard cluster against one server: see ``kvtier.storage.bench_redis``. Private
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
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.core.config import load_config
from kvtier.core.keys import KeyFactory
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta
from kvtier.storage.backends.base import BackendContext, StorageBackend
from kvtier.storage.backends.local_cpu import LocalCPUBackend
from kvtier.storage.manager import TieredStorageManager

TARGETS = {"local_cpu": 0.8, "local_disk": 0.8, "redis": 0.8}


@dataclass(frozen=True)
class Shape:
    name: str
    layout: KVLayout
    tokens: int
    batch: int

    @property
    def meta(self) -> MemoryObjMeta:
        return MemoryObjMeta(self.layout.chunk_shape(self.tokens), self.layout.torch_dtype, self.tokens)


SHAPES = [
    Shape("8b", KVLayout(32, 8, 128, "bfloat16", 16, PagedLayout.FLASH_NHD), 256, 4),
    Shape("small", KVLayout(16, 2, 64, "bfloat16", 16, PagedLayout.FLASH_NHD), 256, 16),
]


def _median_gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _Bench:
    def __init__(self, repeat: int) -> None:
        self.repeat = repeat
        self.rows: list[dict[str, Any]] = []

    def compare(
        self, tier: str, shape: Shape, op: str, nbytes: int,
        ours: Callable[[int], Callable[[], Any]], ref: Callable[[int], Callable[[], Any]],
        cleanup: Callable[[], None] = lambda: None, variant: str | None = None,
    ) -> None:
        """``ours(round)``/``ref(round)`` prepare a round (untimed) and return the timed part."""
        t_ours: list[float] = []
        t_ref: list[float] = []
        for r in range(self.repeat + 1):  # round 0 warms up
            a = _timed(ref(r))
            cleanup()
            b = _timed(ours(r))
            cleanup()
            if r:
                t_ref.append(a)
                t_ours.append(b)
        g, rg = _median_gbps(nbytes, t_ours), _median_gbps(nbytes, t_ref)
        row = {"tier": tier, "shape": shape.name, "op": op, "chunk_bytes": shape.meta.nbytes,
               "batch": shape.batch, "gbps": round(g, 3), "reference_gbps": round(rg, 3),
               "ratio": round(g / rg, 3), "target": TARGETS[tier]}
        if variant:
            row["variant"] = variant
        self.rows.append(row)
        label = f"{op} {variant}" if variant else op
        print(f"{tier:<11}{shape.name:<7}{label:<16}{g:>9.2f}{rg:>11.2f}{g / rg:>8.2f}{TARGETS[tier]:>8.2f}",
              flush=True)


def _arena(nbytes: int) -> HostArena:
    arena = HostArena.create(nbytes)
    arena.buffer.fill_(0)
    return arena


def _fill(obj: MemoryObj, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    obj.tensor.view(torch.int16).copy_(
        torch.randint(-30000, 30000, obj.meta.shape, dtype=torch.int16, generator=g))


def bench_cpu(b: _Bench, shape: Shape) -> None:
    meta = shape.meta
    arena = _arena(meta.nbytes * (2 * shape.batch + 2))
    keys = KeyFactory("bench", shape.layout.fingerprint())
    host = _backend(LocalCPUBackend, shape, arena, tiers=["local_cpu"])
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


def _backend(cls: type[StorageBackend], shape: Shape, arena: HostArena, **cfg: Any) -> StorageBackend:
    config = load_config(overrides={"chunk_size": shape.tokens, **cfg}, env={})
    ns = KeyFactory("bench", shape.layout.fingerprint()).key(b"").namespace()
    key = config.encryption_key_bytes()
    sealer = None
    if key is not None:
        from kvtier.storage.sealing import Sealer

        sealer = Sealer(key)
    return cls(BackendContext(config=config, layout=shape.layout, namespace=ns, arena=arena,
                              sealer=sealer))


def _objects(shape: Shape) -> tuple[HostArena, list[MemoryObj]]:
    meta = shape.meta
    arena = _arena(meta.nbytes * (2 * shape.batch + 2))
    objs = []
    for i in range(shape.batch):
        obj = arena.allocate(meta)
        assert obj is not None
        _fill(obj, i)
        objs.append(obj)
    return arena, objs


def _write_raw(path: str, view: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < view.nbytes:
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_raw(path: str, view: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < view.nbytes:
            n = os.preadv(fd, [view[done:]], done)
            if not n:
                raise OSError(f"{path} is short")
            done += n
    finally:
        os.close(fd)


def _drop_cache(directory: Path) -> None:
    """Evict a directory's (clean, fsync'ed) files from the page cache: the next read hits the
    device."""
    for p in directory.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench_disk(b: _Bench, shape: Shape, disk_dir: Path, *, sealed: bool = False) -> None:
    """The disk tier against raw file I/O; ``sealed``: with ``encryption_key`` (AES-256-GCM),
    rows with variant ``sealed`` (put, page-cache get)."""
    from kvtier.storage.backends.local_disk import LocalDiskBackend

    arena, objs = _objects(shape)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=disk_dir))
    raw_dir = root / "raw"
    raw_dir.mkdir()
    extra = {"encryption_key": os.urandom(32).hex()} if sealed else {}
    disk = _backend(LocalDiskBackend, shape, arena, local_disk_path=str(root / "tier"),
                    local_disk_size_gb=64.0, **extra)
    assert isinstance(disk, LocalDiskBackend)
    keys = KeyFactory("bench", shape.layout.fingerprint())
    nbytes = shape.meta.nbytes * shape.batch
    sink = [np.empty(shape.meta.nbytes, dtype=np.uint8) for _ in range(shape.batch)]

    def k(r: int, i: int):
        return keys.key(r.to_bytes(4, "little") + i.to_bytes(4, "little"))

    def clear() -> None:
        disk.remove([k(r, i) for r in range(b.repeat + 1) for i in range(shape.batch)])
        for p in raw_dir.iterdir():
            p.unlink()

    def raw_put(r: int) -> Callable[[], None]:
        def run() -> None:
            for i, o in enumerate(objs):
                _write_raw(str(raw_dir / f"{i}"), o.byte_view())
        return run

    def put(r: int) -> Callable[[], None]:
        return lambda: disk.batched_put([(k(r, i), o) for i, o in enumerate(objs)])

    cold = False

    def raw_get(r: int) -> Callable[[], None]:
        raw_put(r)()
        if cold:
            _drop_cache(raw_dir)

        def run() -> None:
            for i, buf in enumerate(sink):
                _read_raw(str(raw_dir / f"{i}"), buf.data)
        return run

    def get(r: int) -> Callable[[], None]:
        put(r)()
        if cold:
            _drop_cache(disk.dir)

        def run() -> None:
            got = disk.batched_get([k(r, i) for i in range(shape.batch)], arena.allocate)
            assert all(g is not None for g in got), "disk bench read missed"
            for g in got:
                g.release()  # type: ignore[union-attr]
        return run

    try:
        if sealed:
            b.compare("local_disk", shape, "put", nbytes, put, raw_put, clear, variant="sealed")
            b.compare("local_disk", shape, "get", nbytes, get, raw_get, clear,
                      variant="page-cache sealed")
            return
        b.compare("local_disk", shape, "put", nbytes, put, raw_put, clear)
        b.compare("local_disk", shape, "get", nbytes, get, raw_get, clear, variant="page-cache")
        cold = True
        b.compare("local_disk", shape, "get", nbytes, get, raw_get, clear, variant="from-device")
    finally:
        disk.close()
        for o in objs:
            o.release()
        shutil.rmtree(root, ignore_errors=True)


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    labels = [f"{r['tier']}\n{r['shape']} {r['op']}" + (f"\n{r['variant']}" if "variant" in r else "")
              for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    bars = ax.bar(range(len(rows)), [r["ratio"] for r in rows],
                  color=["tab:blue" if r["ratio"] >= r["target"] else "tab:orange" for r in rows])
    for i, r in enumerate(rows):
        ax.hlines(r["target"], i - 0.4, i + 0.4, colors="black", linestyles="dashed")
        ax.text(i, r["ratio"] + 0.02, f"{r['gbps']:.1f}\n/{r['reference_gbps']:.1f}", ha="center",
                fontsize=7)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("kvtier / reference throughput")
    ax.set_title("kvtier storage tiers vs. reference (dashed: target; labels GB/s ours/ref)")
    ax.set_ylim(0, max(1.2, max(r["ratio"] for r in rows) + 0.2))
    del bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench storage", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small run: 2 rounds, batches halved")
    ap.add_argument("--repeat", type=int, default=15, help="timed rounds per figure (median)")
    ap.add_argument("--tiers", nargs="+", default=["local_cpu", "local_disk", "redis"],
                    choices=["local_cpu", "local_disk", "redis"])
    ap.add_argument("--shapes", nargs="+", default=[s.name for s in SHAPES],
                    choices=[s.name for s in SHAPES])
    ap.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the disk tier and the raw reference files are written")
    ap.add_argument("--no-redis-cluster", action="store_true",
                    help="skip the 3-shard Redis Cluster row")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of the tiers not run from <out>/storage.json (listed in "
                         "its 'merged_tiers': they come from an earlier run)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    repeat = 2 if args.quick else args.repeat
    shapes = [s for s in SHAPES if s.name in args.shapes]
    if args.quick:
        shapes = [Shape(s.name, s.layout, s.tokens, max(1, s.batch // 2)) for s in shapes]
    b = _Bench(repeat)
    server = cluster = None
    redis_note = None
    if "redis" in args.tiers:
        from kvtier.storage import bench_redis

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
    doc = {
        "benchmark": "storage",
        "machine": {"system": platform.platform(), "processor": platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "redis_server": redis_note,
                    "torch_threads": torch.get_num_threads()},
        "params": {"repeat": repeat, "quick": args.quick,
                   "shapes": {s.name: {"chunk_bytes": s.meta.nbytes, "batch": s.batch,
                                       "layers": s.layout.num_layers, "kv_heads": s.layout.num_kv_heads,
                                       "head_size": s.layout.head_size, "tokens": s.tokens}
                              for s in shapes}},
        "reference": {"local_cpu": "memcpy (Tensor.copy_) of the same bytes",
                      "local_disk": "raw write+fsync / read of the same bytes; reads both from the "
                                    "page cache and from the device (cache dropped with fadvise)",
                      "redis": "redis-benchmark SET/GET of values of the tier's segment size over "
                               "the tier's connection count (each row's command in 'reference'); "
                               "the cluster-3 row: the tier reading from one server"},
        "results": b.rows,
    }
    old_path = args.out / "storage.json"
    if args.merge and old_path.exists():
        old = json.loads(old_path.read_text())
        kept: list[dict[str, Any]] = [r for r in old.get("results", []) if r.get("tier") not in args.tiers]
        b.rows = kept + b.rows
        doc["results"] = b.rows
        doc["merged_tiers"] = sorted({r["tier"] for r in kept})
    (args.out / "storage.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out / 'storage.json'}")
    if b.rows:
        _chart(b.rows, args.out / "storage.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host arena start-up (issue 40): from ``create_arena`` to the first 32 MiB store and load served,
and to full capacity, for 4, 16 and 48 GiB arenas, against the code before issue 40 (one
``cudaHostRegister`` of the whole buffer, written out here) in the same run.

    bash benchmarks/gpu_python.sh benchmarks/arena_start.py [--sizes 4 16 48] [--out DIR]

Needs an NVIDIA GPU. Rows per size:

- ``whole``: ``torch.empty`` + one ``cudaHostRegister`` of all of it; the first store waits for it.
- ``segments``: ``CUDAPlatform().create_arena`` (pinned in 256 MiB segments in the background,
  their pages faulted in by ``CUDAPlatform.prefault_threads`` threads first); a 32 MiB store
  (device -> host) and load (host -> device) as soon as an object fits, then one pair every
  20 ms while it grows (their latencies: ``copies``), as a starting server would.
- ``segments-1t``: the same with ``prefault_threads = 0`` (the registration faults the pages in,
  on the pinning thread), no copies after the first.

Copies go through the driver on one stream, split where registrations end, as the mover's lane
does. A probe records what the driver does with a copy that spans two registrations, or a
registration and pageable memory, unsplit. Writes ``arena-start-<device>.json`` and ``.png`` to
``--out`` (default ``benchmarks/results``); the JSON after each size, so a cut-off run keeps what
it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta
from kvtier.cuda._driver import CUDADriverError, driver
from kvtier.cuda.memory import PAGE, REGISTRATIONS, pieces
from kvtier.cuda.platform import CUDAPlatform

GiB, MiB = 1 << 30, 1 << 20
OBJ = 32 * MiB
META = MemoryObjMeta((OBJ,), torch.uint8, 1)
COPY_EVERY_S = 0.02


class Copier:
    """32 MiB copies between one device buffer and host objects on one stream, split where
    registrations end (as ``kvtier.cuda.lane`` does)."""

    def __init__(self) -> None:
        drv = driver()
        assert drv is not None, "libcuda.so.1 did not load"
        self.drv = drv
        self.stream = torch.cuda.Stream()
        self.s = self.stream.cuda_stream
        self.dev = torch.randint(0, 255, (OBJ,), dtype=torch.uint8, device="cuda")
        self.back = torch.empty_like(self.dev)

    def store(self, obj: MemoryObj) -> float:
        t = time.perf_counter()
        host, dev = obj.tensor.data_ptr(), self.dev.data_ptr()
        for off, n in pieces(REGISTRATIONS.cuts, host, host + OBJ):
            self.drv.memcpy_dtoh(host + off, dev + off, n, self.s)
        self.stream.synchronize()
        return time.perf_counter() - t

    def load(self, obj: MemoryObj) -> float:
        t = time.perf_counter()
        host, dev = obj.tensor.data_ptr(), self.back.data_ptr()
        for off, n in pieces(REGISTRATIONS.cuts, host, host + OBJ):
            self.drv.memcpy_htod(dev + off, host + off, n, self.s)
        self.stream.synchronize()
        return time.perf_counter() - t

    def check(self) -> None:
        assert torch.equal(self.back, self.dev), "a copy came back wrong"


def whole(nbytes: int, copier: Copier) -> dict[str, Any]:
    """The code before issue 40: one registration of the whole buffer, then the first copies."""
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    buf = torch.empty(nbytes, dtype=torch.uint8)
    err = cudart.cudaHostRegister(buf.data_ptr(), nbytes, 1)
    t_full = time.perf_counter() - t0
    arena = HostArena(buf)
    obj = arena.allocate(META)
    assert obj is not None
    copier.store(obj)
    t_store = time.perf_counter() - t0
    copier.load(obj)
    t_load = time.perf_counter() - t0
    copier.check()
    after = [copier.store(obj) for _ in range(5)]
    obj.release()
    t = time.perf_counter()
    if err == cudart.cudaError.success:
        cudart.cudaHostUnregister(buf.data_ptr())
    t_close = time.perf_counter() - t
    del arena, buf
    gc.collect()
    return {
        "registered": err == cudart.cudaError.success,
        "first_store_s": t_store,
        "first_load_s": t_load,
        "full_s": t_full,
        "close_s": t_close,
        "store_gbps_after": OBJ / statistics.median(after) / 1e9,
    }


def segments(nbytes: int, copier: Copier, *, threads: int | None, traffic: bool) -> dict[str, Any]:
    """``CUDAPlatform().create_arena``: the first copies as soon as an object fits, then (with
    ``traffic``) a store and a load every 20 ms until it is full."""

    class Platform(CUDAPlatform):
        pass

    if threads is not None:
        Platform.prefault_threads = threads
    t0 = time.perf_counter()
    arena = Platform().create_arena(nbytes)
    t_created = time.perf_counter() - t0
    first = arena.allocate(META)
    while first is None:
        time.sleep(0.0002)
        first = arena.allocate(META)
    t_alloc = time.perf_counter() - t0
    ready_at_first = arena.capacity
    copier.store(first)
    t_store = time.perf_counter() - t0
    copier.load(first)
    t_load = time.perf_counter() - t0
    copier.check()
    held, stores, loads, crossing = [first], [], [], 0
    t_full = None
    while t_full is None:
        if arena.capacity >= arena.target_bytes:
            t_full = time.perf_counter() - t0
            break
        if not traffic:
            time.sleep(0.0005)
            continue
        obj = arena.allocate(META)  # first fit: each new object sits where the arena just grew
        if obj is not None:
            held.append(obj)
            p = obj.tensor.data_ptr()
            crossing += len(pieces(REGISTRATIONS.cuts, p, p + OBJ)) > 1
        target = held[-1]
        stores.append(copier.store(target))
        loads.append(copier.load(target))
        time.sleep(COPY_EVERY_S)
    after = [copier.store(held[-1]) for _ in range(5)]
    regs = REGISTRATIONS.registered(arena.buffer.data_ptr(), arena.buffer.data_ptr() + nbytes)
    for o in held:
        o.release()
    t = time.perf_counter()
    arena.close()
    t_close = time.perf_counter() - t
    del arena, held, first
    gc.collect()
    out: dict[str, Any] = {
        "prefault_threads": Platform.prefault_threads,
        "created_s": t_created,
        "first_alloc_s": t_alloc,
        "ready_bytes_at_first_alloc": ready_at_first,
        "first_store_s": t_store,
        "first_load_s": t_load,
        "full_s": t_full,
        "close_s": t_close,
        "registrations": len(regs),
        "pinned_bytes": sum(hi - lo for lo, hi in regs),
        "store_gbps_after": OBJ / statistics.median(after) / 1e9,
    }
    if stores:
        out["copies"] = {
            "pairs": len(stores),
            "objects_crossing_a_registration": crossing,
            "store_ms_median": 1e3 * statistics.median(stores),
            "store_ms_max": 1e3 * max(stores),
            "load_ms_median": 1e3 * statistics.median(loads),
            "load_ms_max": 1e3 * max(loads),
        }
    return out


def probe() -> dict[str, Any]:
    """Unsplit copies across registrations, on a thread of its own (a refused runtime call
    leaves its error on the calling thread)."""
    result: dict[str, Any] = {}

    def run() -> None:
        torch.cuda.set_device(0)
        drv = driver()
        assert drv is not None
        cudart = torch.cuda.cudart()
        buf = torch.empty(64 * MiB + PAGE, dtype=torch.uint8)
        p0 = -(-buf.data_ptr() // PAGE) * PAGE
        dev = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()

        def copy(host: int) -> str:
            try:
                t = time.perf_counter()
                for _ in range(3):
                    drv.memcpy_dtoh(host, dev.data_ptr(), 16 * MiB, stream.cuda_stream)
                    drv.memcpy_htod(dev.data_ptr(), host, 16 * MiB, stream.cuda_stream)
                stream.synchronize()
                return f"ok, {6 * 16 * MiB / (time.perf_counter() - t) / 1e9:.1f} GB/s"
            except CUDADriverError as e:
                return f"error: {e}"

        ok = cudart.cudaError.success
        a = cudart.cudaHostRegister(p0, 32 * MiB, 1)
        b = cudart.cudaHostRegister(p0 + 32 * MiB, 32 * MiB, 1)
        result["registered_two_neighbours"] = a == ok and b == ok
        result["within_one_registration"] = copy(p0 + 8 * MiB)
        result["across_two_registrations"] = copy(p0 + 24 * MiB)
        cudart.cudaHostUnregister(p0 + 32 * MiB)
        result["across_registered_and_pageable"] = copy(p0 + 24 * MiB)
        # a range sharing a page with a registration (the arena's segments, unrounded)
        c = cudart.cudaHostRegister(p0 + 32 * MiB - 100, MiB, 1)
        result["register_sharing_a_page"] = str(c)
        if c == ok:
            cudart.cudaHostUnregister(p0 + 32 * MiB - 100)
        cudart.cudaHostUnregister(p0)
        result["pageable"] = copy(p0 + 24 * MiB)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(120)
    return result


def machine() -> dict[str, Any]:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {
        "gpu": torch.cuda.get_device_name(),
        "cpus": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "thp": thp.read_text().strip() if thp.exists() else None,
        "memlock": "unlimited" if soft == resource.RLIM_INFINITY else soft,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "page": PAGE,
        "segment_bytes": CUDAPlatform.pin_segment_bytes,
        "prefault_threads": CUDAPlatform.prefault_threads,
    }


def slug(name: str) -> str:
    for known in ("H100", "H200", "B200", "A100", "L40S"):
        if known in name:
            return known.lower()
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["gib"] for r in results["sizes"]]
    series = [
        ("whole: first store", "whole", "first_store_s", "#999999"),
        ("segments: first store", "segments", "first_store_s", "#1f77b4"),
        ("whole: full", "whole", "full_s", "#555555"),
        ("segments: full", "segments", "full_s", "#ff7f0e"),
        ("segments-1t: full", "segments-1t", "full_s", "#2ca02c"),
    ]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.16
    for i, (label, row, key, color) in enumerate(series):
        vals = [r.get(row, {}).get(key) or 0 for r in results["sizes"]]
        xs = [j + (i - 2) * width for j in range(len(sizes))]
        ax.bar(xs, vals, width, label=label, color=color)
        for x, v in zip(xs, vals, strict=True):
            if v:
                ax.text(x, v * 1.08, f"{v:.2g}", ha="center", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(sizes)), [f"{s} GiB" for s in sizes])
    ax.set_ylabel("seconds from create_arena (log)")
    ax.set_title(f"Host arena start-up, {results['machine']['gpu']}")
    ax.axhline(1.0, color="red", lw=0.8, ls="--")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 48], help="GiB")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--no-1t", action="store_true", help="skip the segments-1t rows")
    args = ap.parse_args(argv)
    torch.cuda.init()
    copier = Copier()
    tmp = HostArena(torch.empty(OBJ, dtype=torch.uint8, pin_memory=True))  # warm the copy path
    warm = tmp.allocate(META)
    assert warm is not None
    copier.store(warm)
    copier.load(warm)
    warm.release()
    results: dict[str, Any] = {"machine": machine(), "probe": probe(), "sizes": []}
    print(json.dumps(results, indent=1), flush=True)
    name = slug(results["machine"]["gpu"])
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"arena-start-{name}.json"
    header = f"{'GiB':>4} {'row':<12} {'1st store s':>11} {'1st load s':>10} {'full s':>7} {'close s':>7}"
    print(header, flush=True)
    for gib in args.sizes:
        n = gib * GiB
        row: dict[str, Any] = {"gib": gib}
        row["whole"] = whole(n, copier)
        row["segments"] = segments(n, copier, threads=None, traffic=True)
        if not args.no_1t:
            row["segments-1t"] = segments(n, copier, threads=0, traffic=False)
        results["sizes"].append(row)
        for key in ("whole", "segments", "segments-1t"):
            if key in row:
                r = row[key]
                print(
                    f"{gib:>4} {key:<12} {r['first_store_s']:>11.3f} {r['first_load_s']:>10.3f} "
                    f"{r['full_s']:>7.2f} {r['close_s']:>7.2f}",
                    flush=True,
                )
        if "copies" in row["segments"]:
            print(f"     copies while growing: {row['segments']['copies']}", flush=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

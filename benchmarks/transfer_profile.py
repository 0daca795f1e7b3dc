"""Host-side cost of the operations one transfer call issues, on a CUDA machine.

``python benchmarks/transfer_profile.py``: prints microseconds per operation (alone, and with a
second thread issuing the same operations, as a concurrent store + load does). The transfer
pipeline is host-bound when these add up to more than a piece's PCIe time, so the numbers decide
the staging-slot size (see kvtier.cuda.connector).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import threading
import time
from collections.abc import Callable

import torch

from kvtier.core.connector import Transfer
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import MemoryObjMeta
from kvtier.cuda.connector import CUDAPagedConnector
from kvtier.cuda.kernels import RowGeometry, copy_rows
from kvtier.cuda.platform import CUDAPlatform

N = 400


def _per_op(fn: Callable[[], None], threads: int = 1) -> float:
    fn()
    torch.cuda.synchronize()
    barrier = threading.Barrier(threads)
    times: list[float] = []

    def work() -> None:
        barrier.wait()
        t0 = time.perf_counter()
        for _ in range(N):
            fn()
        times.append(time.perf_counter() - t0)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    torch.cuda.synchronize()
    return max(times) / N * 1e6


def main() -> int:
    arena = CUDAPlatform().create_arena(256 << 20)
    host = arena.allocate(MemoryObjMeta((1 << 12,), torch.uint8, 1))
    assert host is not None
    dev = torch.empty(1 << 12, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    ev = torch.cuda.Event()
    small = torch.zeros(64, dtype=torch.int64)
    geo = RowGeometry(8, 32, 16, 512, 32, 1 << 20)
    slots = torch.zeros(256, dtype=torch.int64, device="cuda")
    src = torch.zeros(1 << 16, dtype=torch.int64, device="cuda")
    table = torch.tensor([[src.data_ptr(), dev.data_ptr(), slots.data_ptr(), 1]], dtype=torch.int64, device="cuda")
    ops: dict[str, Callable[[], None]] = {
        "triton launch (copy_rows)": lambda: copy_rows(table, 1, geo, to_paged=False),
        "copy_ D2H non_blocking 4 KiB": lambda: host.tensor.copy_(dev, non_blocking=True),
        "event record": lambda: ev.record(side),
        "stream wait_event": lambda: side.wait_event(ev),
        "set_stream x2": lambda: (torch.cuda.set_stream(side), torch.cuda.set_stream(torch.cuda.default_stream())),
        "pin_memory 512 B": lambda: small.pin_memory(),
        "torch.cuda.Event()": lambda: torch.cuda.Event(),
    }
    print(f"{'operation':<34} {'1 thread us':>12} {'2 threads us':>13}")
    for name, fn in ops.items():
        print(f"{name:<34} {_per_op(fn):>12.2f} {_per_op(fn, 2):>13.2f}")

    layout = KVLayout(16, 2, 64, "bfloat16", 16, PagedLayout.FLASH_NHD)
    nb = 16 * 16 * 2
    caches = [torch.zeros(layout.expected_cache_shape(nb), dtype=torch.bfloat16, device="cuda") for _ in range(16)]
    conn = CUDAPagedConnector(caches, layout)
    meta = MemoryObjMeta(layout.chunk_shape(256), torch.bfloat16, 256)
    objs = [arena.allocate(meta) for _ in range(16)]
    perm = torch.randperm(nb * 16)
    transfers = [Transfer(o, perm[i * 256 : (i + 1) * 256].clone()) for i, o in enumerate(objs)]  # type: ignore[arg-type]
    conn.store(transfers)
    print(f"{'_prepare, 16 small chunks':<34} {_per_op(lambda: conn._prepare(transfers)):>12.2f}")
    print(f"{'store(), 16 small chunks (32 MiB)':<34} {_per_op(lambda: conn.store(transfers)):>12.2f}")
    print(f"{'load(), 16 small chunks (32 MiB)':<34} {_per_op(lambda: conn.load(transfers)):>12.2f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        conn.store(transfers)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    sys.exit(main())

import statistics
import time

import torch

from kvtier.cuda.bench import _make_case, _measure_limit
from kvtier.cuda.connector import CUDAPagedConnector
from kvtier.cuda.platform import CUDAPlatform

arena = CUDAPlatform().create_arena(4 * 16 * (32 << 20) + (64 << 20))


def med(fn, n=25):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


for shape in ("small", "8b"):
    case = _make_case(shape, 16, arena, seed=5)
    lim = _measure_limit(case.nbytes, arena, 20, 3)
    conns = {}
    for name, sk in (("store table by kernel", True), ("store table by engine", False)):
        c = CUDAPagedConnector(case.caches, case.layout)
        c._store_lane.table_by_kernel = sk
        conns[name] = c
    st, ld = case.store_transfers(), case.load_transfers()
    res = {k: {"store": [], "load": [], "both": []} for k in conns}
    for _ in range(3):
        for name, c in conns.items():
            res[name]["store"].append(lim["store"] / med(lambda c=c: c.store(st)))
            res[name]["load"].append(lim["retrieve"] / med(lambda c=c: c.load(ld)))

            def both(c=c):
                for p in c.store_and_load_async(st, ld):
                    p.wait()

            res[name]["both"].append(2 * lim["store"] / med(both))
    for name, r in res.items():
        print(shape, f"{name:24s}", " ".join(f"{d} " + "/".join(f"{x:.3f}" for x in v) for d, v in r.items()))
    for o in case.store_objs + case.load_objs:
        o.release()

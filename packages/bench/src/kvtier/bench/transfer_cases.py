"""What ``kvtier bench transfer`` times: KV views placed as vLLM 0.32 places them, host objects
in a pinned arena, the mover's calls (alone, two threads at once, streamed), the plain-copy
limit, a per-block DMA alternative for block-outer layouts, and the interleaved medians that time
them together."""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta
from kvtier.core.platform.mover import PageMover, TorchPageMover, Transfer

CHUNK = 256
BLOCK = 16
SHAPES = {"8b": (32, 8, 128), "small": (16, 2, 64)}
# Issue 36's targets: the 8B shape per call, the small one streamed, both directions at once.
TARGETS = {"8b": ("per_call", 0.97), "small": ("streamed", 0.95)}
DUPLEX_TARGET = 1.7

Call = Callable[[], None]


def layout_of(shape: str, paged: PagedLayout) -> KVLayout:
    layers, heads, head = SHAPES[shape]
    return KVLayout(layers, heads, head, "bfloat16", BLOCK, paged, interior="bench")


def vllm_views(layout: KVLayout, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
    """Per-layer views ``[num_blocks, H, N, C]`` of one buffer, placed as vLLM 0.32's
    ``get_kv_cache_config_from_groups`` + ``allocate_kv_cache`` place one cache group's layers:
    strides from ``compute_layout_strides`` in the layout's physical order, a block-outer
    layout's block stride spanning every layer's page (``tests/cuda/test_bench.py`` checks these
    against the test suite's replica, itself checked against vLLM's own allocator)."""
    lay, h, n, c = layout.num_layers, layout.num_kv_heads, layout.block_size, layout.cell_bytes
    shape = (lay, num_blocks, h, n, c)
    order = layout.paged_layout.stride_order
    fixed: list[int | None] = [None] * 5
    if layout.paged_layout.block_outer:
        fixed[1] = layout.page_bytes * lay
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or step
        step = strides[dim] * shape[dim]
    buf = torch.zeros(layout.page_bytes * lay * num_blocks, dtype=torch.int8, device=device)
    view5 = torch.as_strided(buf, shape, strides, 0)
    return [view5[i].view(layout.torch_dtype) for i in range(lay)]


def storage_bytes(view: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``view`` as flat uint8 (writing it writes the cache)."""
    storage = view.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


@dataclass
class Case:
    shape: str
    layout: KVLayout
    views: list[torch.Tensor]
    store_objs: list[MemoryObj]
    load_objs: list[MemoryObj]
    store_blocks: list[torch.Tensor]
    load_blocks: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(o.meta.nbytes for o in self.store_objs)

    def stores(self) -> list[Transfer]:
        return [Transfer(o, b) for o, b in zip(self.store_objs, self.store_blocks, strict=True)]

    def loads(self) -> list[Transfer]:
        return [Transfer(o, b) for o, b in zip(self.load_objs, self.load_blocks, strict=True)]

    def release(self) -> None:
        for o in self.store_objs + self.load_objs:
            o.release()


def make_case(shape: str, paged: PagedLayout, chunks: int, arena: HostArena, seed: int) -> Case:
    """Views of room for a store set and a load set of ``chunks`` chunks, random bytes; blocks
    in random order, as a long-running engine hands them out."""
    layout = layout_of(shape, paged)
    per_chunk = CHUNK // BLOCK
    num_blocks = 2 * chunks * per_chunk + 7
    views = vllm_views(layout, num_blocks, "cuda")
    raw = storage_bytes(views[0])
    gen = torch.Generator(device="cuda").manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda", generator=gen))
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    meta = MemoryObjMeta(layout.chunk_shape(CHUNK), layout.chunk_dtype, CHUNK)

    def objects() -> list[MemoryObj]:
        objs = []
        for _ in range(chunks):
            obj = arena.allocate(meta)
            if obj is None:
                raise MemoryError("benchmark arena too small")
            shape = obj.tensor.shape
            obj.tensor.copy_(
                torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen)
            )
            objs.append(obj)
        return objs

    def blocks(k: int) -> torch.Tensor:
        return perm[k * per_chunk : (k + 1) * per_chunk].clone()

    return Case(
        shape,
        layout,
        views,
        objects(),
        objects(),
        [blocks(k) for k in range(chunks)],
        [blocks(chunks + k) for k in range(chunks)],
    )


def check(case: Case, mover: PageMover, name: str) -> None:
    """``mover``'s bytes equal the torch reference's (a store, then a load, twice: a mover's
    first call in each direction compiles its kernels, the later ones may take another path),
    or raise."""
    twin = vllm_views(case.layout, case.views[0].shape[0], "cuda")
    storage_bytes(twin[0]).copy_(storage_bytes(case.views[0]))
    ref = TorchPageMover(twin, case.layout, mover.num_blocks)
    for _ in range(2):
        for o in case.store_objs:
            o.tensor.zero_()
        mover.store(case.stores())
        got = [o.tensor.clone() for o in case.store_objs]
        ref.store(case.stores())
        if not all(torch.equal(a, o.tensor) for a, o in zip(got, case.store_objs, strict=True)):
            raise AssertionError(f"{name}: stored bytes differ from the torch reference")
        mover.load(case.loads())
        ref.load(case.loads())
        torch.cuda.synchronize()
        if not torch.equal(storage_bytes(case.views[0]), storage_bytes(twin[0])):
            raise AssertionError(f"{name}: loaded cache differs from the torch reference")


def device_slug(name: str) -> str:
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return (m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")).lower()


class Pair:
    """Two persistent threads that run a store and a load at the same moment, on demand (an
    engine's saver and forward threads). Each thread waits on a lock of its own and signals one
    of its own (four lock hand-offs a call): about two thirds of the host time of a
    ``threading.Barrier`` (125-170 us a call against 200-260 us, H200 hosts, both threads' calls
    empty). What is left still counts in a call's time: the bench times the plain copies through
    a pair of these too (``limit-threads``). A call that times out breaks the pair: its threads
    are out of step, so every later call raises."""

    def __init__(self, store: Call, load: Call, timeout: float = 120.0) -> None:
        self._timeout = timeout
        self._go = [threading.Lock(), threading.Lock()]
        self._done = [threading.Lock(), threading.Lock()]
        for lock in self._go + self._done:
            lock.acquire()
        self._stop = False
        self._broken = False
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._loop, args=(i, f), daemon=True)
            for i, f in enumerate((store, load))
        ]
        for t in self._threads:
            t.start()

    def _loop(self, i: int, fn: Call) -> None:
        while True:
            self._go[i].acquire()
            if self._stop:
                return
            try:
                fn()
            except BaseException as e:
                self._errors.append(e)
            self._done[i].release()

    def __call__(self) -> None:
        if self._broken:
            raise RuntimeError("this pair timed out earlier: its threads are out of step")
        for lock in self._go:
            lock.release()
        for lock in self._done:
            if not lock.acquire(timeout=self._timeout):
                self._broken = True
                raise TimeoutError(f"a paired call did not return within {self._timeout} s")
        if self._errors:
            raise self._errors[0]

    def close(self) -> None:
        self._stop = True
        for lock in self._go:
            lock.release()
        for t in self._threads:
            t.join(timeout=30)


def repeated(fn: Call, times: int) -> Call:
    """``fn`` called ``times`` times back to back (a stream of synchronous calls)."""

    def run() -> None:
        for _ in range(times):
            fn()

    return run


def interleaved_medians(calls: dict[str, Call], rounds: int, warmup: int) -> dict[str, float]:
    """Median seconds of each call: every round runs every call once, so a shared machine's
    drift falls on all of them alike; ``warmup`` untimed runs each first. The order rotates by
    one call each round (a call that follows a different kind of call runs slower: the host's
    caches hold the other code path)."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    names = list(calls)
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            calls[name]()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_arena(chunks: int, shapes: Sequence[str]) -> HostArena:
    """A pinned arena holding a case's store and load objects and the limit's two buffers: one
    registration, fully pinned before it is returned (the limit's and the block-DMA rows'
    single copies must not cross a registration; the mover splits its own)."""
    from kvtier.cuda.memory import wait_grown
    from kvtier.cuda.platform import CUDAPlatform

    class OneRegistration(CUDAPlatform):
        pin_segment_bytes = 1 << 62

    largest = max(layout_of(s, PagedLayout.LBHNC).chunk_nbytes(CHUNK) for s in shapes)
    arena = OneRegistration().create_arena(4 * chunks * largest + (64 << 20))
    if not wait_grown(arena, 600.0):
        raise RuntimeError("the benchmark arena was not pinned within 600 s")
    return arena


def limit_calls(nbytes: int, arena: HostArena) -> tuple[dict[str, Call], Call]:
    """One contiguous pinned-host copy of ``nbytes`` each way, each on its own stream, and both
    at once: calls keyed ``store``/``load``/``both`` that return with the copies done; and the
    call that releases their host objects."""
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    objs = [arena.allocate(MemoryObjMeta((nbytes,), torch.uint8, 1)) for _ in range(2)]
    held = [o for o in objs if o is not None]

    def release() -> None:
        for o in held:
            o.release()

    if len(held) < 2:
        release()
        raise MemoryError("benchmark arena too small")
    host_out, host_in = held[0].tensor, held[1].tensor
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def d2h() -> None:
        with torch.cuda.stream(s1):
            host_out.copy_(dev_out, non_blocking=True)

    def h2d() -> None:
        with torch.cuda.stream(s2):
            dev_in.copy_(host_in, non_blocking=True)

    def waited(*issue: Call) -> Call:
        def call() -> None:
            for i in issue:
                i()
            s1.synchronize()
            s2.synchronize()

        return call

    return {"store": waited(d2h), "load": waited(h2d), "both": waited(d2h, h2d)}, release


def block_dma_calls(case: Case, mover: PageMover) -> dict[str, Call] | None:
    """For a block-outer, block-compact layout (one block's every layer is one run): one DMA
    per block straight between the cache and the host objects, issued from Python on one stream;
    None for other layouts. The alternative to the mover's kernel that the layout-preference
    decision weighs (``docs/cuda-performance.md``)."""
    if not mover.block_runs:
        return None
    from kvtier.cuda._driver import driver

    drv = driver()
    assert drv is not None
    row = case.layout.num_layers * case.layout.page_bytes
    base = case.views[0].untyped_storage().data_ptr() + mover.runs.offset
    stride = mover.runs.block_stride
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream

    def pairs(transfers: list[Transfer]) -> list[tuple[int, int]]:
        return [
            (t.obj.tensor.data_ptr() + j * row, base + int(b) * stride)
            for t in transfers
            for j, b in enumerate(t.blocks.tolist())
        ]

    out, into = pairs(case.stores()), pairs(case.loads())

    def store() -> None:
        for host, dev in out:
            drv.memcpy_dtoh(host, dev, row, handle)
        stream.synchronize()

    def load() -> None:
        for host, dev in into:
            drv.memcpy_htod(dev, host, row, handle)
        stream.synchronize()

    return {"store": store, "load": load}

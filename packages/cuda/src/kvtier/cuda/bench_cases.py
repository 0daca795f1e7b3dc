"""The cases and calls ``kvtier bench transfer`` times: model shapes, host objects in a pinned
arena, the connector's calls (one at a time, streamed, from two threads), the plain-copy
limit, and the interleaved medians that time them together."""

from __future__ import annotations

import collections
import re
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.core.connector import TorchPagedConnector, Transfer
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta

CHUNK = 256
BLOCK = 16
SHAPES = {"8b": (32, 8, 128), "small": (16, 2, 64)}
TARGETS = {"8b": 0.95, "small": 0.85}
DUPLEX_TARGET = 1.7


@dataclass
class Case:
    shape: str
    layout: KVLayout
    caches: list[torch.Tensor]
    store_objs: list[MemoryObj]
    load_objs: list[MemoryObj]
    store_slots: list[torch.Tensor]
    load_slots: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(o.meta.nbytes for o in self.store_objs)

    def store_transfers(self) -> list[Transfer]:
        return [Transfer(o, s) for o, s in zip(self.store_objs, self.store_slots, strict=True)]

    def load_transfers(self) -> list[Transfer]:
        return [Transfer(o, s) for o, s in zip(self.load_objs, self.load_slots, strict=True)]


def device_slug(name: str) -> str:
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return (m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")).lower()


def median_seconds(fn: Callable[[], None], repeat: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_case(shape: str, chunks: int, arena: HostArena, seed: int) -> Case:
    layers, heads, head = SHAPES[shape]
    layout = KVLayout(layers, heads, head, "bfloat16", BLOCK, PagedLayout.FLASH_NHD)
    blocks_per_chunk = CHUNK // BLOCK
    num_blocks = 2 * chunks * blocks_per_chunk + 7  # room for a store set and a load set
    gen = torch.Generator(device="cuda").manual_seed(seed)
    caches = [
        torch.randn(layout.expected_cache_shape(num_blocks), device="cuda", generator=gen).to(
            torch.bfloat16
        )
        for _ in range(layers)
    ]
    # Blocks in random order, as a long-running engine hands them out.
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    offsets = torch.arange(BLOCK)

    def slots_of(k: int) -> torch.Tensor:
        ids = perm[k * blocks_per_chunk : (k + 1) * blocks_per_chunk]
        return (ids[:, None] * BLOCK + offsets).reshape(-1)

    meta = MemoryObjMeta(layout.chunk_shape(CHUNK), torch.bfloat16, CHUNK)

    def objects() -> list[MemoryObj]:
        objs = []
        for _ in range(chunks):
            obj = arena.allocate(meta)
            if obj is None:
                raise MemoryError("benchmark arena too small")
            obj.tensor.normal_()
            objs.append(obj)
        return objs

    return Case(
        shape=shape,
        layout=layout,
        caches=caches,
        store_objs=objects(),
        load_objs=objects(),
        store_slots=[slots_of(k) for k in range(chunks)],
        load_slots=[slots_of(chunks + k) for k in range(chunks)],
    )


def release_case(case: Case) -> None:
    for o in case.store_objs + case.load_objs:
        o.release()


def check(case: Case, conn, name: str) -> None:
    """The connector's bytes equal the torch reference's (store and load), or raise."""
    ref = TorchPagedConnector([c.clone() for c in case.caches], case.layout)
    conn.store(case.store_transfers())
    got = [o.tensor.clone() for o in case.store_objs]
    ref.store(case.store_transfers())
    if not all(
        torch.equal(a.view(torch.int16), o.tensor.view(torch.int16))
        for a, o in zip(got, case.store_objs, strict=True)
    ):
        raise AssertionError(f"{name}: stored bytes differ from the torch reference")
    conn.load(case.load_transfers())
    ref.load(case.load_transfers())
    torch.cuda.synchronize()
    for a, b in zip(conn.kv_caches, ref.kv_caches, strict=True):
        if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
            raise AssertionError(f"{name}: loaded cache differs from the torch reference")


class Pair:
    """Two persistent threads that run a store and a load at the same moment, on demand."""

    def __init__(self, store: Callable[[], None], load: Callable[[], None]) -> None:
        self._start = threading.Barrier(3, timeout=120)
        self._end = threading.Barrier(3, timeout=120)
        self._stop = False
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._loop, args=(f,), daemon=True) for f in (store, load)
        ]
        for t in self._threads:
            t.start()

    def _loop(self, fn: Callable[[], None]) -> None:
        while True:
            self._start.wait()
            if self._stop:
                return
            try:
                fn()
            except BaseException as e:
                self._errors.append(e)
            self._end.wait()

    def __call__(self) -> None:
        self._start.wait()
        self._end.wait()
        if self._errors:
            raise self._errors[0]

    def close(self) -> None:
        self._stop = True
        self._start.wait()
        for t in self._threads:
            t.join(timeout=30)


def whole_calls(case: Case, conn) -> dict[str, Callable[[], None]]:
    """The case's whole calls on ``conn``, each returning with its copies done: ``store``,
    ``load`` and ``both`` (``store_and_load_async`` from one thread, both waited)."""
    stores, loads = case.store_transfers(), case.load_transfers()

    def both() -> None:
        for pending in conn.store_and_load_async(stores, loads):
            pending.wait()

    return {"store": lambda: conn.store(stores), "load": lambda: conn.load(loads), "both": both}


def async_calls(case: Case, conn) -> dict[str, Callable[[], list[Any]]]:
    """The case's calls through the ``_async`` API, keyed like ``_measure_connector``'s rows:
    each issues one call and returns its pending transfers (``wait()`` each)."""
    stores, loads = case.store_transfers(), case.load_transfers()
    return {
        "store": lambda: [conn.store_async(stores)],
        "retrieve": lambda: [conn.load_async(loads)],
        "both": lambda: list(conn.store_and_load_async(stores, loads)),
    }


def stream(issue: Callable[[], list[Any]], calls: int, in_flight: int) -> Callable[[], None]:
    """A call that makes ``calls`` calls of ``issue`` back to back, at most ``in_flight``
    outstanding (before a call the oldest is waited for when that many are), and waits for all."""
    if calls < 1 or in_flight < 1:
        raise ValueError(f"calls and in_flight must be >= 1, got {calls} and {in_flight}")

    def stream() -> None:
        outstanding: collections.deque[list[Any]] = collections.deque()
        for _ in range(calls):
            while len(outstanding) >= in_flight:
                for pending in outstanding.popleft():
                    pending.wait()
            outstanding.append(issue())
        while outstanding:
            for pending in outstanding.popleft():
                pending.wait()

    return stream


def interleaved_medians(
    calls: dict[str, tuple[Callable[[], None], Callable[[], None]]],
    rounds: int,
    per_round: int = 3,
    warmup: int = 3,
) -> dict[str, float]:
    """Median seconds of each ``name: (fn, apply)``: every round runs every call ``per_round``
    times, ``apply()`` first, so a shared machine's drift falls on all of them alike.
    ``warmup`` untimed runs each first. The order rotates by one call each round, so every call
    runs after every other about equally often (a call that follows a different kind of call
    runs slower: the host's caches hold the other code path)."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for fn, apply in calls.values():
        apply()
        for _ in range(warmup):
            fn()
    names = list(calls)
    for r in range(rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            fn, apply = calls[name]
            apply()
            for _ in range(per_round):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_arena(chunks: int, shapes: Sequence[str]) -> HostArena:
    """A pinned arena holding a case's store and load objects of ``chunks`` chunks of the largest
    of ``shapes``, and the plain copies' buffers of ``_limit_calls``."""
    from kvtier.cuda.platform import CUDAPlatform

    largest = max(chunk_nbytes(s) for s in shapes)
    return CUDAPlatform().create_arena(4 * chunks * largest + (64 << 20))


class Queued:
    """A copy queued on a stream, waited like a PendingTransfer."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def wait(self) -> None:
        self._event.synchronize()


def limit_calls(
    nbytes: int, arena: HostArena
) -> tuple[dict[str, Callable[[], list[Any]]], Callable[[], None]]:
    """One contiguous copy of ``nbytes`` each way (pinned host <-> device, each on its own
    stream), and both at once, as calls keyed ``store``/``retrieve``/``both`` that queue the
    copies and return their waiters (for ``stream``); and the call that releases
    their host objects."""
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

    def d2h() -> list[Any]:
        with torch.cuda.stream(s1):
            host_out.copy_(dev_out, non_blocking=True)
        return [Queued(s1)]

    def h2d() -> list[Any]:
        with torch.cuda.stream(s2):
            dev_in.copy_(host_in, non_blocking=True)
        return [Queued(s2)]

    return {"store": d2h, "retrieve": h2d, "both": lambda: d2h() + h2d()}, release


def waited(issue: Callable[[], list[Any]]) -> Callable[[], None]:
    """``issue`` as a call that returns with its copies done."""

    def call() -> None:
        for q in issue():
            q.wait()

    return call


def chunk_nbytes(shape: str) -> int:
    """Bytes of one chunk of ``shape`` (bf16, flash layout), as the benchmark stores it."""
    return KVLayout(*SHAPES[shape], "bfloat16", BLOCK, PagedLayout.FLASH_NHD).chunk_nbytes(CHUNK)

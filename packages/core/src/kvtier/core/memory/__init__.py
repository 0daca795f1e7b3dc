"""Host memory: one arena per process, and memory objects carved from it.

Ownership is explicit. ``HostArena.allocate`` returns a ``MemoryObj``: a *handle*. Each handle is
released exactly once (``release()`` or leaving a ``with`` block); ``share()`` makes another
handle on the same bytes for another holder (a tier that indexes it, a reader that borrows it).
The bytes go back to the arena when the last handle is released. Releasing a handle twice, or
sharing a released one, raises ``DoubleReleaseError``: a bug is loud, never a silent double free.

``MemoryObj.borrowed`` makes a handle on bytes outside the arena that another owner keeps (the node
tier's read-only mappings of shared memory): the same contract, with ``arena`` None; the bytes
stay valid while any handle (or any tensor taken from one) is alive.
"""

from __future__ import annotations

import bisect
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.core.errors import DoubleReleaseError, OutOfHostMemory


@dataclass(frozen=True)
class MemoryObjMeta:
    """What a memory object holds: ``shape``/``dtype`` of the tensor view and its token count."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    num_tokens: int

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class HostArena:
    """A fixed block of host memory (pinned where the platform pins) with a first-fit allocator.

    Thread-safe. ``allocate`` never blocks and never spins: it returns ``None`` when the bytes are
    not there, and the caller (a storage tier) decides whether to evict and try again
    (``allocate_evicting``).

    Growth: an arena may start with only its first ``ready_bytes`` usable (``capacity``) and
    grow to ``target_bytes`` as a background thread pins it segment by segment
    (``kvtier.core.memory.arena_growth``): objects are only ever carved from ready bytes, so a transfer
    never touches memory still being page-locked, and nothing waits for the whole arena.
    """

    def __init__(
        self, buffer: torch.Tensor, *, alignment: int = 256, ready_bytes: int | None = None
    ) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError("HostArena needs a one-dimensional uint8 buffer")
        if buffer.device.type != "cpu":
            raise ValueError(f"HostArena needs a host (cpu) buffer, got one on {buffer.device}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.buffer = buffer
        self.alignment = alignment
        self.target_bytes = (buffer.numel() // alignment) * alignment
        ready = self.target_bytes if ready_bytes is None else ready_bytes // alignment * alignment
        self.capacity = max(0, min(ready, self.target_bytes))  # usable now
        self._lock = threading.Lock()
        # Free extents as two parallel sorted lists (offset -> size), coalesced on free.
        self._free_offsets: list[int] = [0] if self.capacity else []
        self._free_sizes: list[int] = [self.capacity] if self.capacity else []
        self._used = 0
        self._closers: list[Callable[[], None]] = []
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer viewed as each dtype
        self._base = buffer.storage_offset()  # the buffer may be a slice of a larger tensor
        # The platform copies from page-locked host memory: the arena is pinned, or being pinned
        # in the background (``Platform.create_arena``). A tier that could hand out other host
        # memory (the node tier's mappings) must not, then.
        self.for_pinned_copies = bool(buffer.is_pinned())

    @classmethod
    def create(cls, nbytes: int, *, pin_memory: bool = False, alignment: int = 256) -> HostArena:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        return cls(buf, alignment=alignment)

    @property
    def used_bytes(self) -> int:
        return self._used

    def grow(self, upto: int) -> int:
        """Make the bytes up to ``upto`` usable (at most ``target_bytes``); returns the new
        capacity. Called as background pinning finishes a segment; never shrinks."""
        with self._lock:
            upto = min(upto // self.alignment * self.alignment, self.target_bytes)
            start = self.capacity
            if upto <= start:
                return start
            if self._free_offsets and self._free_offsets[-1] + self._free_sizes[-1] == start:
                self._free_sizes[-1] += upto - start
            else:
                self._free_offsets.append(start)
                self._free_sizes.append(upto - start)
            self.capacity = upto
            return upto

    def on_close(self, closer: Callable[[], None]) -> None:
        """Run ``closer`` at ``close()`` (a background grower stops there)."""
        self._closers.append(closer)

    def close(self) -> None:
        """Stop anything still preparing the arena (idempotent); its objects stay valid."""
        closers, self._closers = self._closers, []
        for closer in closers:
            closer()

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used

    @property
    def is_pinned(self) -> bool:
        """Whether the buffer is page-locked now (see also ``for_pinned_copies``)."""
        return bool(self.buffer.is_pinned())

    def _round(self, nbytes: int) -> int:
        a = self.alignment
        return max(a, (nbytes + a - 1) // a * a)

    def allocate(self, meta: MemoryObjMeta) -> MemoryObj | None:
        """A new object for ``meta``, or ``None`` if no free extent is large enough."""
        size = self._round(meta.nbytes)
        with self._lock:
            for i, free in enumerate(self._free_sizes):
                if free >= size:
                    offset = self._free_offsets[i]
                    if free == size:
                        del self._free_offsets[i]
                        del self._free_sizes[i]
                    else:
                        self._free_offsets[i] = offset + size
                        self._free_sizes[i] = free - size
                    self._used += size
                    break
            else:
                return None
        try:
            return MemoryObj(_Allocation(self, offset, size), meta)
        except BaseException:
            self._free(offset, size)
            raise

    def allocate_evicting(
        self, meta: MemoryObjMeta, evict_one: Callable[[], bool] | None
    ) -> MemoryObj | None:
        """Allocate, evicting through ``evict_one`` (returns False when nothing more can go).

        Terminates: every round either allocates, frees one object, or gives up.
        """
        size = self._round(meta.nbytes)
        if size > self.target_bytes:
            raise OutOfHostMemory(
                f"a {meta.nbytes}-byte object cannot fit a {self.target_bytes}-byte host arena"
            )
        while True:
            obj = self.allocate(meta)
            if obj is not None or evict_one is None:
                return obj
            # While the arena is still growing, evicting cannot make room past what is ready.
            if size > self.capacity or not evict_one():
                return None

    def tensor_at(self, offset: int, meta: MemoryObjMeta) -> torch.Tensor:
        """A contiguous tensor of ``meta``'s shape and dtype over the arena's bytes at ``offset``.

        One ``as_strided`` of a view of the whole buffer as ``meta.dtype`` (made once per dtype),
        instead of a slice and two views: this runs for every object allocated, once per chunk a
        tier reads, where three torch calls cost about as much as the chunk's header check."""
        itemsize = meta.dtype.itemsize
        base = self._base
        if base % itemsize or offset % itemsize:
            raise ValueError(
                f"an object of {meta.dtype} at byte {offset} of an arena whose buffer starts at "
                f"byte {base} of its storage: not aligned to the dtype's {itemsize} bytes"
            )
        typed = self._typed.get(meta.dtype)
        if typed is None:  # two threads may both make it: either view is the same
            # Made outside inference mode even when the first allocation runs inside it (a
            # layer-wise load in the forward pass): a view made there could not be updated in
            # place outside it, and this one outlives the call.
            with torch.inference_mode(False):
                whole = self.buffer[: self.buffer.numel() // itemsize * itemsize]
                typed = self._typed[meta.dtype] = whole.view(meta.dtype)
        # as_strided's offset counts from the start of the storage, not of the view
        return typed.as_strided(
            meta.shape, _contiguous_strides(meta.shape), (base + offset) // itemsize
        )

    def _free(self, offset: int, size: int) -> None:
        with self._lock:
            self._used -= size
            i = bisect.bisect_left(self._free_offsets, offset)
            if i < len(self._free_offsets) and offset + size == self._free_offsets[i]:
                size += self._free_sizes[i]
                del self._free_offsets[i]
                del self._free_sizes[i]
            if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:
                self._free_sizes[i - 1] += size
            else:
                self._free_offsets.insert(i, offset)
                self._free_sizes.insert(i, size)


@functools.lru_cache(maxsize=256)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class _Allocation:
    """The bytes behind one or more handles; returned to the arena when the last handle goes.
    Without an arena (``MemoryObj.borrowed``), another owner frees them when the last tensor
    over them goes."""

    __slots__ = ("arena", "handles", "lock", "nbytes", "offset")

    def __init__(self, arena: HostArena | None, offset: int, nbytes: int) -> None:
        self.arena = arena
        self.offset = offset
        self.nbytes = nbytes
        self.handles = 1
        self.lock = threading.Lock()

    def drop(self) -> None:
        with self.lock:
            self.handles -= 1
            last = self.handles == 0
        if last and self.arena is not None:
            self.arena._free(self.offset, self.nbytes)


_NOTHING = torch.empty(0, dtype=torch.uint8)


class MemoryObj:
    """A handle on one chunk of KV in host memory. Release it exactly once.

    ``tensor`` is a view of the arena shaped ``meta.shape`` with ``meta.dtype`` (or of borrowed
    bytes, ``borrowed``); it is valid until this handle is released.
    """

    __slots__ = ("_address", "_alloc", "_released", "_tensor", "meta")

    def __init__(self, alloc: _Allocation, meta: MemoryObjMeta) -> None:
        assert alloc.arena is not None  # borrowed bytes are made by ``borrowed``
        self._alloc = alloc
        self.meta = meta
        self._released = False
        self._tensor = alloc.arena.tensor_at(alloc.offset, meta)
        self._address = self._tensor.data_ptr()

    @classmethod
    def borrowed(cls, tensor: torch.Tensor, meta: MemoryObjMeta) -> MemoryObj:
        """A handle on ``tensor``'s bytes, which are not the arena's (a read-only mapping of
        shared memory): ``tensor`` must be a contiguous host tensor of ``meta``'s shape and
        dtype; its owner keeps the bytes alive while the tensor is referenced. ``arena`` is
        None: nothing returns to an arena on release, and a tier that keeps arena objects
        (the host tier) does not take it."""
        if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
            raise ValueError(
                f"a borrowed tensor {tuple(tensor.shape)} {tensor.dtype} does not match "
                f"{meta.shape} {meta.dtype}"
            )
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("a borrowed tensor must be a contiguous host tensor")
        obj = cls.__new__(cls)
        obj._alloc = _Allocation(None, 0, meta.nbytes)
        obj.meta = meta
        obj._released = False
        obj._tensor = tensor
        obj._address = tensor.data_ptr()
        return obj

    @property
    def tensor(self) -> torch.Tensor:
        if self._released:
            raise DoubleReleaseError("memory object used after release")
        return self._tensor

    @property
    def address(self) -> int:
        """The host address of the object's first byte (``tensor.data_ptr()``, without a torch
        call: a mover reads it for every chunk of a call)."""
        if self._released:
            raise DoubleReleaseError("memory object used after release")
        return self._address

    @property
    def released(self) -> bool:
        return self._released

    @property
    def arena(self) -> HostArena | None:
        """The arena whose buffer holds the bytes (objects of one arena that sit back to back
        can be moved as one contiguous range); None for ``borrowed`` bytes."""
        return self._alloc.arena

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def holders(self) -> int:
        """How many unreleased handles share these bytes (this one included, if unreleased).

        A tier uses it to skip evicting an object someone else still holds.
        """
        return self._alloc.handles

    def byte_view(self) -> memoryview:
        """The object's bytes (no copy), for writing to a file or a socket."""
        return memoryview(self.tensor.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]

    def share(self) -> MemoryObj:
        """Another handle on the same bytes, for another holder; release it separately."""
        with self._alloc.lock:
            if self._released:
                raise DoubleReleaseError("cannot share a released memory object")
            self._alloc.handles += 1
        twin = MemoryObj.__new__(MemoryObj)
        twin._alloc = self._alloc
        twin.meta = self.meta
        twin._released = False
        twin._tensor = self._tensor
        twin._address = self._address
        return twin

    def release(self) -> None:
        """Give this handle back. The bytes are freed when the last handle is released."""
        with self._alloc.lock:
            if self._released:
                raise DoubleReleaseError("memory object handle released twice")
            self._released = True
        if self._alloc.arena is None:
            self._tensor = _NOTHING  # borrowed bytes are freed when the last tensor goes
        self._alloc.drop()

    def __enter__(self) -> MemoryObj:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"{self._alloc.handles} handle(s)"
        return f"MemoryObj(shape={self.meta.shape}, dtype={self.meta.dtype}, {state})"

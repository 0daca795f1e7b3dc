"""Node-tier chunks read in place: each file mapped into the process once, checked once.

A node-tier file is shared memory (tmpfs pages). Reading it into the host arena moves every byte
twice (the file into the arena, the arena into the KV cache) and faults nothing in that the next
hit could reuse. Instead a chunk file is mapped read-only (``MAP_SHARED``: the same pages every
process maps, no copy), its header and checksum are checked over the mapping the first time this
process reads it, and the payload is handed out as a borrowed ``MemoryObj``: the KV cache is
filled with one copy from the shared pages, as from the process's own host memory.

The mappings are kept (``MappedChunks``): a later hit on the same file costs an ``open``, an
``fstat`` and the copy. A mapping holds its file's inode, so while it is kept no other file can
get its inode number: a file at the chunk's path with the same device and inode *is* the
verified file, and files are never changed in place (a chunk appears by ``rename`` and leaves
by ``unlink``). A mapping pins its pages after another process deletes the file; kept mappings
whose file is gone are dropped at least every ``node_rescan_s``, and at most ``MAX_MAPPINGS``
(and no more bytes than the node's budget) are kept, least recently used dropped first. A
handed-out object keeps its mapping alive until it (and every tensor taken from it) is gone.

Read-only: a write into a borrowed chunk faults (a kvtier bug made loud), it never changes
another process's KV.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvtier.core.memory import MemoryObjMeta

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

# Each mapping is one kernel memory area (``vm.max_map_count`` is 65530 by default).
MAX_MAPPINGS = 4096


class _Unmap:
    """Unmaps ``size`` bytes at ``addr`` when the last reference goes (a tensor over the mapping
    holds the buffer that holds this)."""

    __slots__ = ("addr", "size")

    def __init__(self, addr: int, size: int) -> None:
        self.addr, self.size = addr, size

    def __del__(self) -> None:
        libc.munmap(self.addr, self.size)


def map_file(fd: int, size: int) -> torch.Tensor:
    """The ``size`` bytes of the open file ``fd``, mapped read-only and shared, as a uint8
    tensor; no file descriptor is kept (Python's ``mmap`` keeps one per mapping). The mapping
    is removed when the last tensor over it is freed. Raises ``OSError``."""
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
    owner = _Unmap(addr, size)
    buf = (ctypes.c_ubyte * size).from_address(addr)
    buf._unmap = owner  # type: ignore[attr-defined]  # the buffer keeps the mapping
    # torch warns about no buffer it is given here: a ctypes array reports itself writable.
    return torch.frombuffer(buf, dtype=torch.uint8)


class Mapped(NamedTuple):
    ident: tuple[int, int]  # (st_dev, st_ino) of the mapped file
    payload: torch.Tensor  # the checked payload, shaped and typed as the chunk
    meta: MemoryObjMeta
    nbytes: int  # the whole file's


def file_ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class MappedChunks:
    """The mappings this process keeps, by chunk file name (thread-safe)."""

    def __init__(self, max_bytes: int, interval_s: float, max_count: int = MAX_MAPPINGS) -> None:
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.interval_s = interval_s
        self._maps: OrderedDict[str, Mapped] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._pruned_at = time.monotonic()

    def __contains__(self, name: str) -> bool:
        return name in self._maps

    def get(self, name: str, st: os.stat_result) -> Mapped | None:
        """The checked payload of ``name`` if the file just opened (``st``) is the one mapped."""
        with self._lock:
            got = self._maps.get(name)
            if got is None:
                return None
            if got.ident != file_ident(st):
                self._pop(name)  # another file now: a new chunk, checked when it is mapped
                return None
            self._maps.move_to_end(name)
            return got

    def put(
        self, name: str, st: os.stat_result, payload: torch.Tensor, meta: MemoryObjMeta
    ) -> Mapped:
        got = Mapped(file_ident(st), payload, meta, st.st_size)
        with self._lock:
            if name in self._maps:
                self._pop(name)
            self._maps[name] = got
            self._bytes += st.st_size
            while self._maps and (len(self._maps) > self.max_count or self._bytes > self.max_bytes):
                self._pop(next(iter(self._maps)))
        return got

    def _pop(self, name: str) -> None:
        got = self._maps.pop(name, None)
        if got is not None:
            self._bytes -= got.nbytes

    def drop(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                self._pop(name)

    def prune_if_due(self, stat_of: Callable[[str], os.stat_result]) -> None:
        """Drop the mappings whose file is gone or replaced (``stat_of(name)`` raises or shows
        another inode), at most every ``interval_s``: their pages go back to the system once no
        reader holds them."""
        now = time.monotonic()
        with self._lock:
            if now - self._pruned_at < self.interval_s:
                return
            self._pruned_at = now
            idents = {name: m.ident for name, m in self._maps.items()}
        gone = []
        for name, ident in idents.items():
            try:
                if file_ident(stat_of(name)) != ident:
                    gone.append(name)
            except OSError:
                gone.append(name)
        with self._lock:
            for name in gone:
                got = self._maps.get(name)
                if got is not None and got.ident == idents[name]:  # not mapped again since
                    self._pop(name)

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()
            self._bytes = 0

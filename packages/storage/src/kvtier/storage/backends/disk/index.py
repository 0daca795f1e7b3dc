"""The disk tier's bookkeeping: which chunk files it counts against its budget (LRU order), which
of them it has checked, which are being read, and what to evict. Thread-safe; touches no file
(the tier deletes the names it is handed, and scans its directory for ``sync``); ``ScanPacer``
says when the next scan is due."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

# (inode, size, mtime) of a file whose header (or whole content) was checked.
Ident = tuple[int, int, int]


def ident(st: os.stat_result) -> Ident:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class DiskIndex:
    """File name -> bytes, oldest first, under ``budget`` bytes.

    Eviction skips files being read (``reading``). After the file system fills up below the
    budget, ``cap_at_used`` lowers the budget to what is held, for ``cap_s`` seconds.
    """

    def __init__(self, budget: int, cap_s: float) -> None:
        self.budget = budget
        self._cap_s = cap_s
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        # Every name's index epoch when it was last indexed: a scan that started before then
        # may not have seen its file (``sync``).
        self._epoch = 0
        self._since: dict[str, int] = {}
        self._checked: dict[str, Ident] = {}
        self._reading: dict[str, int] = {}
        self._used = 0
        self._reserved = 0
        self._cap = 0
        self._cap_until = 0.0

    @property
    def used(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[str]:
        """Names, least recently used first (a snapshot)."""
        with self._lock:
            return iter(list(self._sizes))

    def sizes(self) -> list[tuple[str, int]]:
        """``(name, bytes)`` of every indexed file, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._sizes.items())

    def load(self, files: list[tuple[str, int]]) -> None:
        """Index ``(name, bytes)`` found on disk (oldest first), not yet checked."""
        with self._lock:
            for name, size in files:
                self._index_locked(name, size)

    def epoch(self) -> int:
        """Where the index is now: give it to ``sync`` with a scan started after this call."""
        with self._lock:
            self._epoch += 1
            return self._epoch

    def sync(self, found: list[tuple[str, int]], since: int) -> None:
        """Make the index match a scan of the directory (``(name, bytes)``, oldest first) that
        started at ``epoch()`` ``since``: files other processes wrote join it as the most
        recently used, files they deleted (or replaced) leave it. A name indexed after the scan
        started is left as it is (the scan may have missed its file)."""
        on_disk = dict(found)
        with self._lock:
            for name in list(self._sizes):
                if self._since[name] < since and on_disk.get(name) != self._sizes[name]:
                    self._forget_locked(name)
            for name, size in found:
                if name not in self._sizes:
                    self._index_locked(name, size)

    def _index_locked(self, name: str, size: int) -> None:
        self._sizes[name] = size
        self._since[name] = self._epoch
        self._used += size

    def _forget_locked(self, name: str) -> None:
        self._checked.pop(name, None)
        self._since.pop(name, None)
        size = self._sizes.pop(name, None)
        if size is not None:
            self._used -= size

    def forget(self, name: str) -> None:
        with self._lock:
            self._forget_locked(name)

    def record(self, name: str, st: os.stat_result) -> None:
        """Index ``name`` as the checked file ``st``, most recently used."""
        with self._lock:
            self._forget_locked(name)
            self._index_locked(name, st.st_size)
            self._checked[name] = ident(st)

    def trusted(self, name: str, st: os.stat_result) -> bool:
        """Whether ``st`` is the very file checked under ``name``; if so it becomes most recent."""
        with self._lock:
            if self._checked.get(name) != ident(st):
                return False
            self._sizes.move_to_end(name)
            return True

    def reading(self, name: str) -> bool:
        """Whether a read of ``name`` is in progress in this process."""
        with self._lock:
            return bool(self._reading.get(name))

    def begin_read(self, name: str) -> None:
        with self._lock:
            self._reading[name] = self._reading.get(name, 0) + 1

    def end_read(self, name: str) -> None:
        with self._lock:
            left = self._reading[name] - 1
            if left:
                self._reading[name] = left
            else:
                del self._reading[name]

    def _limit(self) -> int:
        if time.monotonic() < self._cap_until:
            return min(self.budget, self._cap)
        return self.budget

    def _evict_locked(self, incoming: int) -> tuple[bool, list[str]]:
        limit = self._limit()
        victims: list[str] = []
        skipped = 0
        while self._used + self._reserved + incoming > limit and skipped < len(self._sizes):
            name = next(iter(self._sizes))
            if self._reading.get(name):
                self._sizes.move_to_end(name)
                skipped += 1
                continue
            self._forget_locked(name)
            victims.append(name)
        return self._used + self._reserved + incoming <= limit, victims

    def evict_to_budget(self) -> list[str]:
        """Names to delete so what is indexed fits the budget."""
        with self._lock:
            return self._evict_locked(0)[1]

    def reserve(self, size: int) -> tuple[bool, list[str]]:
        """Make room for a ``size``-byte file and reserve it; ``(reserved, names to delete)``
        (not reserved when files being read are all that could go)."""
        with self._lock:
            ok, victims = self._evict_locked(size)
            if ok:
                self._reserved += size
            return ok, victims

    def unreserve(self, size: int) -> None:
        with self._lock:
            self._reserved -= size

    def cap_at_used(self) -> tuple[int, list[str]]:
        """The file system is full: cap the budget at what is held (for ``cap_s``) and evict
        until the reservations in flight fit; ``(the cap, names to delete)``."""
        with self._lock:
            self._cap = self._used
            self._cap_until = time.monotonic() + self._cap_s
            return self._cap, self._evict_locked(0)[1]


class ScanPacer:
    """When the tier's next directory scan is due: ``begin()`` says whether to scan now (one
    thread at a time), ``end()`` after it. Scans come at most every ``interval_s`` (0: every
    time), and a scan that took long pushes the next one out so that scans take at most
    ``1 / SHARE_INVERSE`` of the scanning thread's time."""

    SHARE_INVERSE = 100

    def __init__(self, interval_s: float) -> None:
        self._interval = interval_s
        self._lock = threading.Lock()
        self._next = time.monotonic() + interval_s
        self._started = 0.0

    def begin(self) -> bool:
        if time.monotonic() < self._next or not self._lock.acquire(blocking=False):
            return False
        self._started = time.monotonic()
        return True

    def end(self) -> None:
        now = time.monotonic()
        if self._interval:
            self._next = now + max(self._interval, self.SHARE_INVERSE * (now - self._started))
        else:
            self._next = now
        self._lock.release()

"""Reading one batch of chunk files on several threads (the disk tier's ``batched_get``).

A page-cache read of a chunk is a copy out of the kernel, the checksum of what landed and some
per-chunk work in Python (open, header, allocation); one after the other on one thread they fall
well short of a raw read of the same bytes. Here the calling thread and ``threads - 1`` helpers
take the batch's chunks one at a time, each reading a whole chunk and hashing every segment right
after it lands (still in that core's cache), so one thread's hashing and Python work overlap
another's copying. Results keep the keys' order; if a read raises, the objects the others delivered
are released before the error propagates, and the call returns only after every helper is done
with the caller's ``allocate`` callback.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.core.memory import MemoryObj

# One per core, up to four: while one thread runs a chunk's Python (header, allocation) holding
# the GIL, the others copy and hash. More threads than cores only queue for them
# (docs/storage-decisions.md).
DEFAULT_READ_THREADS = max(1, min(4, os.cpu_count() or 1))


class BatchReaders:
    """Runs ``read(i)`` for ``i`` in ``range(n)`` on the caller plus up to ``threads - 1`` helpers."""

    def __init__(self, threads: int = DEFAULT_READ_THREADS) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _helpers(self) -> ThreadPoolExecutor | None:
        """The helper pool (started on first use); None once closed: reads then run serially."""
        with self._lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.threads - 1, thread_name_prefix="kvtier-disk-read"
                )
            return self._pool

    def map(self, read: Callable[[int], MemoryObj | None], n: int) -> list[MemoryObj | None]:
        """``[read(0), ..., read(n - 1)]``, the reads spread over the threads."""
        helpers = min(self.threads, n) - 1
        pool = self._helpers() if helpers > 0 else None
        if pool is None:
            return [read(i) for i in range(n)]
        out: list[MemoryObj | None] = [None] * n
        taken = iter(range(n))
        take_lock = threading.Lock()

        def work() -> None:
            while True:
                with take_lock:
                    i = next(taken, None)
                if i is None:
                    return
                out[i] = read(i)

        futures: list[Future[None]] = [pool.submit(work) for _ in range(helpers)]
        errors: list[BaseException] = []
        try:
            work()
        except BaseException as e:
            errors.append(e)
            with take_lock:  # the helpers take nothing more
                for _ in taken:
                    pass
        for f in futures:
            err = f.exception()  # waits: reads are bounded by the files' sizes
            if err is not None:
                errors.append(err)
        if errors:
            for obj in out:
                if obj is not None:
                    obj.release()
            raise errors[0]
        return out

    def close(self) -> None:
        """Stop the helper threads (after the reads in progress)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

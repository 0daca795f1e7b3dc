"""CPU time used by kvtier's own threads in this process: the metric ``background_cpu_seconds``.

kvtier's threads are named ``kvtier-...`` (tier writers, checksum helpers, disk and Redis
readers, probes, the vLLM connector's loader and saver). ``ThreadCPU.seconds()`` sums what the
kernel counts for each of them, read from ``/proc/self/task/<tid>/schedstat`` (nanoseconds on
the CPU) or, without schedstat, ``/proc/self/task/<tid>/stat`` (user + system clock ticks); a
thread that has ended keeps the last value read, so the sum only grows. It reads ``/proc`` at
most once per ``min_interval_s`` (a few microseconds a thread) and returns the last sum in
between. Where ``/proc`` is missing (not Linux) the sum stays 0.
"""

from __future__ import annotations

import os
import threading
import time

PREFIX = "kvtier-"
_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def _cpu_seconds(tid: int) -> float | None:
    """The CPU time of thread ``tid`` of this process, or None if it is gone (or unreadable)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            # the fields after the command name (which may hold spaces) start after its ")"
            fields = f.read().rpartition(b")")[2].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


class ThreadCPU:
    """Cumulative CPU seconds of this process's ``kvtier-*`` threads. Thread-safe."""

    def __init__(self, min_interval_s: float = 1.0) -> None:
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._live: dict[threading.Thread, float] = {}  # CPU seconds last read
        self._ended = 0.0  # last values of threads that have ended
        self._total = 0.0
        self._read_at = -float("inf")

    def seconds(self) -> float:
        with self._lock:
            now = time.monotonic()
            if now - self._read_at < self.min_interval_s:
                return self._total
            self._read_at = now
            threads = [
                t
                for t in threading.enumerate()
                if t.name.startswith(PREFIX) and t.native_id is not None
            ]
            alive = set(threads)
            for t in list(self._live):
                if t not in alive:
                    self._ended += self._live.pop(t)
            for t in threads:
                cpu = _cpu_seconds(t.native_id)  # type: ignore[arg-type]
                if cpu is not None:
                    self._live[t] = max(cpu, self._live.get(t, 0.0))
            self._total = self._ended + sum(self._live.values())
            return self._total


# One per process (the vLLM connector's worker reports it).
PROCESS_THREADS = ThreadCPU()

"""One thread at a time issues a connector's whole-chunk calls.

Calls from several threads at once (vLLM saves from a saver thread while the forward thread
loads) are issued by one of them: the first becomes the issuer, and a call made while it issues
is handed to it and stepped in turn with its own, as ``store_and_load_async`` does from one
thread. Two threads issuing at once would trade the GIL at every driver call, so each would
issue at about half speed. The handing-over thread waits on an event (no GIL) until its call is
issued, then waits for its copies itself. Each call keeps its own caller's stream order (read
when the call is made). The issuer returns once every call it took is issued.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Generator
from typing import Any

# How long a call handed to another thread's issuer may wait before it starts.
HANDOFF_TIMEOUT_S = 120.0

Steps = Generator[None, None, Any]


class _Unit:
    """The step generators of one call, stepped by whichever thread issues, with their results
    or first error kept for the calling thread."""

    __slots__ = ("done", "error", "gens", "results", "retry")

    def __init__(self, gens: list[Steps]) -> None:
        self.gens: list[Steps | None] = list(gens)
        self.results: list[Any] = [None] * len(gens)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.retry = False  # handed back unstarted: the calling thread issues it itself

    def fail(self, error: BaseException) -> None:
        """Keep the first error; close (drain) the unit's other calls."""
        self.error = error
        for i, gen in enumerate(self.gens):
            if gen is not None:
                self.gens[i] = None
                with contextlib.suppress(BaseException):  # the first error is the one reported
                    gen.close()

    def step(self) -> bool:
        """Advance each of the unit's calls by one step; whether all are finished."""
        for i, gen in enumerate(self.gens):
            if gen is None:
                continue
            try:
                next(gen)
            except StopIteration as end:
                self.results[i] = end.value
                self.gens[i] = None
            except BaseException as e:  # kept for the call's own thread
                self.fail(e)
                break
        return all(gen is None for gen in self.gens)

    def result(self) -> list[Any]:
        if self.error is not None:
            raise self.error
        return self.results


class Issuer:
    """Runs calls' steps to the end, one issuing thread at a time (see module doc)."""

    def __init__(self, handoff_timeout_s: float = HANDOFF_TIMEOUT_S) -> None:
        self._lock = threading.Lock()
        self._issuing = False
        self._mailbox: list[_Unit] = []
        self._timeout_s = handoff_timeout_s

    def issue(self, gens: list[Steps]) -> list[Any]:
        """Step ``gens`` (one call's generators, interleaved) to the end; their results in order."""
        unit = _Unit(gens)
        with self._lock:
            handed = self._issuing
            if handed:
                self._mailbox.append(unit)
            self._issuing = True
        if handed:
            return self._await(unit, gens)
        units = [unit]
        try:
            while True:
                self._step_all(units)
                with self._lock:
                    if not self._mailbox:
                        self._issuing = False
                        break
                    units, self._mailbox = self._mailbox, []
        except BaseException as e:
            # Only an interruption of the loop itself gets here (a call's own error is kept in
            # its unit): calls started here are drained and fail with it, calls not started
            # yet go back to their threads, which issue them.
            for started in units:
                if not started.done.is_set():
                    started.fail(e)
                    started.done.set()
            with self._lock:
                waiting, self._mailbox, self._issuing = self._mailbox, [], False
            for other in waiting:
                other.retry = True
                other.done.set()
            raise
        return unit.result()

    def _await(self, unit: _Unit, gens: list[Steps]) -> list[Any]:
        """Wait (bounded) for the issuer to run a handed-over call; issue it here if handed back."""
        deadline = time.monotonic() + self._timeout_s
        while not unit.done.wait(timeout=min(1.0, self._timeout_s)):
            if time.monotonic() > deadline:
                with self._lock:
                    if unit in self._mailbox:  # not started: safe to withdraw
                        self._mailbox.remove(unit)
                        for gen in gens:
                            gen.close()
                        raise TimeoutError(
                            f"a transfer call waited {self._timeout_s:.0f} s for the thread issuing "
                            "another call on this connector; nothing of it was enqueued"
                        )
                # Started: its steps are being issued and end with the call; keep waiting.
        if unit.retry:
            return self.issue(gens)
        return unit.result()

    def _step_all(self, units: list[_Unit]) -> None:
        """Step every call of ``units`` in turn until all are issued, taking calls handed over
        meanwhile (between rounds)."""
        while units:
            for unit in list(units):
                if unit.step():
                    unit.done.set()
                    units.remove(unit)
            if self._mailbox:  # a hint; taken under the lock
                with self._lock:
                    units.extend(self._mailbox)
                    self._mailbox = []

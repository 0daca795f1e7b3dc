"""Which hits load in the step that schedules their request, and which on the loader thread (a
policy: it writes no request state; ``scheduler/request.py`` asks it).

An asynchronous load (``load_async``) keeps its request in WAITING_FOR_REMOTE_KVS until the
worker reports the load done, so the request runs a step later than with vLLM's own prefix
cache, and the load competes for the interpreter with vLLM's engine loop, which spins through
empty steps while a request waits (docs/serving.md measures both). A hit whose bytes are already
in host memory needs neither: answered as a synchronous load, vLLM schedules the request in the
same step and the worker copies its chunks before the forward pass (``worker/loads.py``), or on
the CPU platform beside it, layer by layer (``worker/layer_pipe.py``), as vLLM's prefix cache
would serve it, plus the copy.

A hit loads so when

- its bytes are in host memory now: a probe's hold has them (lower-tier hits are read into host
  memory by the probe), or, answered by the index, every rank has each of its chunks in host
  memory with no save of it still copying (``PresenceIndex.where``);
- the step's synchronous loads, this one included, add up to at most ``sync_load_mb`` per rank:
  the copy delays every request of the step, so a long one goes to the loader thread;
- the model has one KV cache group: vLLM maps failed blocks of a synchronous load back to its
  requests only then (a hybrid's failed loads are reported by request, which vLLM accepts for
  asynchronous loads only).

A hit whose chunks are still being saved to host memory (the request came while the save of the
same prefix was copying, or before an idle engine heard that it was done) is answered "not yet"
until every rank reports the save copied, and then loads so; after ``lookup_timeout_s`` it goes
to the loader thread, which waits for the save itself.

A chunk evicted between an index answer and the load makes the load come up short, as on the
loader thread: vLLM recomputes from the first block not loaded (``kv_load_failure_policy=
"recompute"``, which index answers need) and discards that step's output of the request. That
step's save of the request would store the blocks the load did not fill: the workers drop it
(``WorkerLoads.take_unfilled``) and the scheduler saves the request again after the recompute
(``TrackedRequest.failed_load``, ``short``). With vLLM's async scheduling the next step is
scheduled before the failure is known, and its save could still read those blocks; vLLM 0.32's
recompute of a failed synchronous load does not mark that step's output stale either (only
preemption does, ``num_stale_output_tokens``), so its token would come from the unfilled
blocks. There a hit answered by the index loads on the loader thread (a probe's hold never
falls short).
"""

from __future__ import annotations

import time

from kvtier.core.config import KVTierConfig
from kvtier.vllm_integration.scheduler.index import HOST, SAVING, PresenceIndex
from kvtier.vllm_integration.scheduler.prompts import IndexedPrompt, Probe


class SyncLoads:
    """The synchronous-load budget of the step being scheduled (see the module docstring)."""

    def __init__(
        self,
        config: KVTierConfig,
        index: PresenceIndex,
        token_bytes: int,
        *,
        one_group: bool,
        async_scheduling: bool = False,
    ) -> None:
        """``token_bytes``: the KV bytes of one token on one rank (every layer); 0 = unknown
        (no hit loads synchronously). ``async_scheduling``: vLLM's; a hit answered by the index
        then loads on the loader thread (see the module docstring)."""
        on = config.loads_async and one_group and token_bytes > 0
        self.indexed = not async_scheduling
        self.limit = int(config.sync_load_mb * (1 << 20)) if on else 0
        self.wait_s = config.lookup_timeout_s
        self.index = index
        self.token_bytes = token_bytes
        self._left = self.limit
        self._waiting: dict[str, float] = {}  # request -> when its hit was first found saving
        self.taken = 0  # hits answered as synchronous loads
        self.deferred = 0  # lookups answered "not yet" while the hit's saves were copying

    def decide(
        self, rid: str, hashes: IndexedPrompt, probe: Probe, hit: int, new: int
    ) -> bool | None:
        """For a hit of ``hit`` tokens, ``new`` of them to load: True if it may load before
        this step's forward pass (``take`` then counts it), False if on the loader thread, None
        if not yet (its chunks are still being saved)."""
        nbytes = new * self.token_bytes
        if nbytes <= 0 or nbytes > self._left:
            self._waiting.pop(rid, None)
            return False
        if probe.indexed and not self.indexed:
            return False
        where = hashes.where(self.index, hit) if probe.indexed else HOST
        if where == SAVING:
            first = self._waiting.setdefault(rid, time.monotonic())
            if time.monotonic() - first < self.wait_s:
                self.deferred += 1
                return None
        self._waiting.pop(rid, None)
        return where == HOST

    def take(self, new: int) -> None:
        """A hit of ``new`` tokens is answered as a synchronous load in this step."""
        self._left -= new * self.token_bytes
        self.taken += 1

    def forget(self, rid: str) -> None:
        """Request ``rid`` is done."""
        self._waiting.pop(rid, None)

    def next_step(self) -> None:
        """The step's metadata is built: the next step has the whole budget again."""
        self._left = self.limit

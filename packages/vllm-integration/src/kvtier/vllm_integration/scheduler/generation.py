"""The weights generation: what ``reset_cache`` does to keys, decided by the live weights.

RL frameworks update an engine's weights in place (``collective_rpc``) and then call
``reset_prefix_cache``; operators call it to start over. Neither may serve KV of weights no longer
loaded, and instances with the same weights must keep sharing. So a reset does not draw a random
number: it bumps the *weights epoch*, every worker digests its live parameters when the next
step's metadata reaches it and says whether they differ from its own at start
(``RankReport.weights``), and once every rank has answered:

- no rank's changed: the weights are those the key's model part names already, the generation
  stays None (the cache stays valid and shared);
- otherwise the generation is the digests combined (``weights.combine``): every instance that
  made the same change agrees on it, and an instance with other weights never does.

Between the reset and the answers (one engine step) lookups answer "not yet" and no save is
planned; if the answers do not come within ``lookup_timeout_s`` (a worker gone), requests are
computed and nothing is saved until they do. Requests that started before a change mix weights:
they are never served or saved again (their ``RequestState.generation`` never equals the new
one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvtier.vllm_integration.weights import combine

logger = logging.getLogger("kvtier")


class WeightsGeneration:
    """The scheduler's view of the weights its workers serve (see the module docstring)."""

    def __init__(self, num_workers: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.num_workers = num_workers
        self._clock = clock
        self._since = 0.0  # when the last reset was asked for
        self.epoch = 0  # bumped by every reset
        self.current: str | None = None  # the generation keys are made under now
        self._answers: dict[int, str] = {}  # rank -> its digest for ``epoch``
        self._changed = False  # whether any rank's weights differ from those at its start

    @property
    def pending(self) -> bool:
        """A reset waits for the workers' digests: nothing is looked up or saved meanwhile."""
        return self.epoch > 0 and len(self._answers) < self.num_workers

    @property
    def for_new_requests(self) -> str | None:
        """The generation a request that arrives now computes under (while a reset is pending,
        one no answer can equal)."""
        return f"pending-{self.epoch}" if self.pending else self.current

    def reset(self) -> None:
        self.epoch += 1
        self._answers = {}
        self._changed = False
        self._since = self._clock()

    def waited(self) -> float:
        """Seconds since the last reset was asked for."""
        return self._clock() - self._since

    def report(self, rank: int, epoch: int, digest: str, changed: bool) -> None:
        """A worker's digest of its live weights as of ``epoch``, and whether they differ from
        those it started with."""
        if epoch != self.epoch or not self.pending:
            return  # an older reset's answer
        self._answers[rank] = digest
        self._changed = self._changed or changed
        if self.pending:
            return
        self.current = combine(self._answers) if self._changed else None
        logger.info(
            "kvtier: cache reset %d: the weights are %s (generation %s)",
            self.epoch,
            "those loaded at start" if self.current is None else "new",
            self.current,
        )

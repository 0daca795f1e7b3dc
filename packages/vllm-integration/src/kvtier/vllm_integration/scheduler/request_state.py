"""A request's state on the scheduler side, and the phases of its life: the only writer of it.

``TrackedRequest`` is what kvtier remembers of one live request. Every field is written by one
of its methods, each named after the event that causes it, and every change of ``phase`` is
checked against ``TRANSITIONS`` (a change not listed there is a bug in kvtier and raises
``LifecycleError``). Who raises the events, and what they ask of the policies, is
``scheduler/request.py``; docs/architecture.md draws the phases.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core.keys import KeyScope
from kvtier.vllm_integration.identity import keyable
from kvtier.vllm_integration.scheduler.prompts import IndexedPrompt, Probe

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvtier.vllm_integration.scheduler.index import PresenceIndex


class Phase(enum.Enum):
    """Where a request is in its life, as kvtier sees it."""

    NEW = "new"  # tracked; not asked for a hit yet
    LOOKING_UP = "looking up"  # asked; the answer is not ready (a probe, a producer, a reset)
    ANSWERED = "answered"  # vLLM was told its hit (0 included); a probe's hold waits for the load
    SAMPLED = "sampled"  # told no hit, so vLLM computes the prefix kvtier will check
    LOADING = "loading"  # blocks allocated for its hit; the load goes out with the next step
    RUNNING = "running"  # scheduled: its computed chunks are saved, a sampled one's checked
    PREEMPTED = "preempted"  # its KV is gone; it waits to be asked again
    FINISHED = "finished"


P = Phase
# Every change of phase the code makes, with the event that makes it (docs/architecture.md
# lists the same table; a test keeps them equal).
TRANSITIONS: dict[tuple[Phase, Phase], str] = {
    (P.NEW, P.LOOKING_UP): "lookup: not yet",
    (P.NEW, P.ANSWERED): "lookup: a hit or a miss",
    (P.NEW, P.SAMPLED): "lookup: sampled for verification",
    (P.NEW, P.RUNNING): "allocated, never asked",
    (P.LOOKING_UP, P.ANSWERED): "lookup: a hit or a miss",
    (P.LOOKING_UP, P.SAMPLED): "lookup: sampled for verification",
    (P.LOOKING_UP, P.RUNNING): "allocated, the lookup not used (vLLM read no cache)",
    (P.ANSWERED, P.LOOKING_UP): "lookup: probed again",
    (P.ANSWERED, P.SAMPLED): "lookup: sampled for verification",
    (P.ANSWERED, P.LOADING): "allocated with external tokens",
    (P.ANSWERED, P.RUNNING): "allocated, nothing to load",
    (P.SAMPLED, P.RUNNING): "allocated, nothing to load",
    (P.LOADING, P.RUNNING): "the load went out",
    (P.LOADING, P.ANSWERED): "lookup: asked again after a failed load",
    (P.RUNNING, P.PREEMPTED): "preempted",
    (P.PREEMPTED, P.LOOKING_UP): "lookup: not yet",
    (P.PREEMPTED, P.ANSWERED): "lookup: a hit or a miss",
    (P.PREEMPTED, P.SAMPLED): "lookup: sampled for verification",
    (P.PREEMPTED, P.RUNNING): "allocated, never asked",
    **{(p, P.FINISHED): "finished" for p in Phase if p is not P.FINISHED},
}


class LifecycleError(RuntimeError):
    """A change of phase ``TRANSITIONS`` does not list (a bug in kvtier)."""


@dataclass
class PendingVerify:
    """A request sampled for verification (``scheduler/verify.py``): checked once vLLM has
    computed tokens ``[start, end)`` itself."""

    start: int  # tokens vLLM had already (its prefix cache): not recomputed, not compared
    end: int  # the hit the lookup found
    hold_id: int | None  # the workers' hold of the hit (None: the index answered)


@dataclass(frozen=True)
class Hashing:
    """How a request's prompt is cut into the engine's chunks (``IndexedPrompt``)."""

    chunk_size: int
    block_size: int
    save_unfull_chunk: bool


@dataclass(frozen=True)
class SaveProgress:
    """What a request has handed to the workers for saving (``scheduler/save_plan.py``)."""

    saved_upto: int  # tokens
    prompt_saved: bool


@dataclass(eq=False)
class TrackedRequest:
    """What the scheduler side tracks for one live request (see the module docstring)."""

    request: Request
    adapter: str | None
    prompt: np.ndarray  # identity tokens of the prompt
    generation: str | None  # the generation its KV is computed under
    hashing: Hashing
    transitions: Counter[tuple[Phase, Phase]] = field(default_factory=Counter)  # shared, seen
    phase: Phase = Phase.NEW
    block_ids: list[int] = field(default_factory=list)
    external: int = 0  # tokens to load in the request's next scheduled step
    hold_id: int | None = None  # the worker's hold those tokens are loaded from
    probe: Probe | None = None  # the lookup in flight or answered, not yet used by a load
    computed_at_lookup: int = 0  # tokens vLLM already had (its prefix cache) at the lookup
    load_async: bool = False  # what the last lookup answered
    saved_upto: int = 0  # tokens handed to the worker for saving
    prompt_saved: bool = False
    last_save_step: int = -1  # the step whose metadata carried its last save (-1: none)
    # A load of it failed (vLLM recomputes the blocks): never offered again, so a chunk that
    # cannot be loaded is not retried step after step.
    load_failed: bool = False
    verify: PendingVerify | None = None  # sampled for verification, its check not sent yet
    verify_step: int = -1  # the step whose metadata carried its check (-1: none)
    # A hybrid model's live block ids of every KV cache group this step, and the first token
    # from which every window group still has its blocks (``scheduler/hybrid.py``).
    groups: list[list[int]] | None = None
    live_from: int = 0
    _indexed: tuple[int, int] = (-1, 0)  # (index version, tokens it said) at the last lookup

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def cacheable(self) -> bool:
        """Whether it may be looked up and saved (``identity.keyable``, with the adapter
        identity taken when it arrived)."""
        return keyable(self.request, self.adapter)

    @property
    def scope(self) -> KeyScope:
        return KeyScope(self.request.cache_salt, self.adapter, self.generation)

    @cached_property
    def hashes(self) -> IndexedPrompt:
        """Its chunk hashes, computed once and only as far as they are needed."""
        h = self.hashing
        return IndexedPrompt(
            self.prompt, self.scope, h.chunk_size, h.block_size, h.save_unfull_chunk
        )

    def indexed_hit(self, index: PresenceIndex) -> int:
        """Tokens the index says every rank stores (asked every step a request waits: hashed
        once per index version)."""
        version, hit = self._indexed
        if version != index.version:
            hit = self.hashes.indexed_hit(index)
            self._indexed = (index.version, hit)
        return hit

    def _go(self, to: Phase) -> None:
        if to is self.phase:
            return
        if (self.phase, to) not in TRANSITIONS:
            raise LifecycleError(
                f"kvtier: request {self.rid} cannot go from {self.phase.value} to {to.value}"
            )
        self.transitions[(self.phase, to)] += 1
        self.phase = to

    # The lookup (vLLM's get_num_new_matched_tokens).

    def looking_up(self, probe: Probe | None) -> None:
        """Asked, not answered yet; ``probe`` is the one in flight (None: none is)."""
        self._go(P.LOOKING_UP)
        self.probe = probe

    def drop_probe(self) -> Probe | None:
        """Forget its probe (its hold is released or handed to a load); return it."""
        probe, self.probe = self.probe, None
        return probe

    def answered(self, probe: Probe | None, computed: int, load_async: bool) -> None:
        """vLLM is told the hit ``probe`` found beyond ``computed`` tokens (it had those)."""
        self._go(P.ANSWERED)
        self.probe = probe
        self.computed_at_lookup = computed
        self.load_async = load_async

    def answered_nothing(self) -> None:
        """Told no hit without a lookup (a failed load, other weights, a check pending)."""
        self._go(P.SAMPLED if self.verify is not None else P.ANSWERED)

    def sampled(self, check: PendingVerify) -> None:
        """Told no hit: vLLM computes the prefix, which is checked against ``check``'s hold."""
        self._go(P.SAMPLED)
        self.verify = check
        self.probe = None  # its hold now belongs to the check

    # Allocation (vLLM's update_state_after_alloc).

    def allocated(self, external: int, hold_id: int | None) -> None:
        """Blocks for ``external`` hit tokens, loaded with its first scheduled step."""
        self._go(P.LOADING)
        self.external, self.hold_id = external, hold_id

    def allocated_async(self, block_ids: list[int], end: int) -> None:
        """Blocks for a hit that loads while it waits; the tokens before ``end`` are stored."""
        self._go(P.LOADING)
        self.block_ids = list(block_ids)  # where a failed load is reported
        self.external = 0
        self._stored_through(end)

    def allocated_nothing(self) -> None:
        """Scheduled with nothing to load."""
        self._go(P.RUNNING)
        self.external = 0

    def _stored_through(self, end: int) -> None:
        c = self.hashing.chunk_size
        self.saved_upto = max(self.saved_upto, end // c * c)

    # Each scheduled step (vLLM's build_connector_meta).

    def load_sent(self, end: int) -> None:
        """Its load (the tokens before ``end``) went out with this step."""
        self._go(P.RUNNING)
        self.hold_id = None
        self.external = 0
        self._stored_through(end)  # everything before the loaded chunk's start is stored

    def scheduled_first(self, block_ids: list[int], computed: int) -> None:
        """Scheduled the first time: its blocks; vLLM had ``computed`` tokens (its prefix
        cache's, which a check does not recompute)."""
        self.block_ids = list(block_ids)
        if self.verify is not None:
            self.verify.start = max(self.verify.start, computed)

    def blocks_added(self, block_ids: list[int]) -> None:
        self.block_ids.extend(block_ids)

    def resumed(self, block_ids: list[int]) -> None:
        """Scheduled again after a preemption: all its blocks."""
        self.block_ids = list(block_ids)

    def kept_blocks(self, block_ids: list[int]) -> None:
        """At its finish: the blocks vLLM keeps cached (what a lazy save reads)."""
        self.block_ids = list(block_ids)

    def groups_seen(self, groups: list[list[int]], live_from: int) -> None:
        """A hybrid model's live block ids of every group, this step."""
        self.groups, self.live_from = groups, live_from

    def save_planned(self, progress: SaveProgress) -> None:
        self.saved_upto, self.prompt_saved = progress.saved_upto, progress.prompt_saved

    def save_sent(self, step: int) -> None:
        """A save of it went out with step ``step`` (its blocks are held until it is copied)."""
        self.last_save_step = step

    def check_sent(self, step: int) -> None:
        self.verify = None
        self.verify_step = step

    def preempted(self) -> None:
        """Its KV is gone; what was saved stays saved, the rest is saved again on resume."""
        self._go(P.PREEMPTED)
        self.block_ids = []
        self.prompt_saved = False
        self.saved_upto = 0

    # What the workers report (vLLM's update_connector_output).

    def failed_load(self) -> None:
        """A load of it failed: vLLM recomputes it, which is saved again (a save made with a
        load before the forward pass was dropped by the workers); it is not offered a hit
        again."""
        self.load_failed = True
        self.saved_upto, self.prompt_saved = 0, False

    def short(self, found: int) -> None:
        """A load found only its first ``found`` tokens: vLLM recomputes the rest, which is
        saved again."""
        c = self.hashing.chunk_size
        self.saved_upto = min(self.saved_upto, found // c * c)
        if found < len(self.prompt):
            self.prompt_saved = False

    def finished(self) -> None:
        self._go(P.FINISHED)

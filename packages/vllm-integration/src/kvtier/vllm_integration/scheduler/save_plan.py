"""Which tokens of a request a save stores, decided on the scheduler side.

Mid-prefill, the full chunks computed so far; once the prompt is computed, the whole prompt
(the engine stores its block-aligned tail as tail blocks with ``save_unfull_chunk``); with
``save_decode_cache``, chunks filled by generated tokens too. ``store_threshold`` cuts a save
to the chunks enough requests contained. A save never repeats what an earlier one (or the
request's load) already covered (``RequestState.saved_upto``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.config import KVTierConfig
from kvtier.vllm_integration.identity import identity_tokens
from kvtier.vllm_integration.messages import SaveSpec
from kvtier.vllm_integration.scheduler.events import EventLog
from kvtier.vllm_integration.scheduler.index import PresenceIndex
from kvtier.vllm_integration.scheduler.lookups import RequestState
from kvtier.vllm_integration.scheduler.prompts import IndexedPrompt, Sightings


class SavePlanner:
    """Turns "tokens ``[0, end)`` of this request have KV" into the ``SaveSpec`` to send."""

    def __init__(
        self,
        config: KVTierConfig,
        block_size: int,
        sightings: Sightings,
        hashes: Callable[[RequestState], IndexedPrompt],
        index: PresenceIndex | None = None,
        events: EventLog | None = None,
    ) -> None:
        """``index`` and ``events``: told what each save will store (``expect``)."""
        self.index = index
        self.events = events
        self.config = config
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self.sightings = sightings
        self._hashes = hashes

    @property
    def step(self) -> int:
        """The granularity the engine stores at: blocks with tail blocks, else chunks."""
        return self.block_size if self.config.save_unfull_chunk else self.chunk_size

    def plan(
        self, rid: str, state: RequestState, end: int, generation: str | None
    ) -> SaveSpec | None:
        """The save tokens ``[0, end)`` make possible (None: nothing new to store); updates
        the request's save progress."""
        req = state.request
        if not state.cacheable or state.generation != generation:
            return None
        prompt_len = req.num_prompt_tokens
        c = self.chunk_size
        if end < prompt_len:
            save_end = end // c * c  # mid-prefill: full chunks only
        elif not state.prompt_saved:
            state.prompt_saved = True
            save_end = prompt_len  # the engine stores the block-aligned tail as a partial chunk
            if self.config.save_decode_cache:
                save_end = max(save_end, min(end, len(req.all_token_ids)) // c * c)
        elif self.config.save_decode_cache:
            save_end = min(end, len(req.all_token_ids)) // c * c
        else:
            return None
        if self.sightings.threshold > 1 and save_end <= len(state.prompt):
            # Only chunks enough requests contained (store_threshold).
            save_end = min(save_end, self.sightings.storable(self._hashes(state)))
        # Nothing the engine would store (whole chunks, or blocks with save_unfull_chunk) means
        # no save, so no blocks are held.
        if save_end - save_end % self.step <= state.saved_upto:
            return None
        skip = state.saved_upto // c * c
        state.saved_upto = save_end
        if state.live_from > skip:
            # A hybrid model's window blocks before it are freed: those chunks cannot be stored.
            skip = -(-state.live_from // c) * c
            if skip >= save_end:
                return None
        n_blocks = -(-save_end // self.block_size)
        if save_end <= len(state.prompt):
            tokens = state.prompt[:save_end]
        else:
            tokens = identity_tokens(req, req.all_token_ids[:save_end])
        return SaveSpec(rid, tokens, list(state.block_ids[:n_blocks]), skip, state.scope)

    def expect(self, state: RequestState, skip: int, end: int) -> None:
        """Tell the index (and the KV event log) what a save just asked for will store: its
        chunks and tail blocks, and the aliases of its full chunks (a prompt diverging inside
        one of them hits its first blocks)."""
        assert self.index is not None and self.events is not None, "not bound to an index"
        hashes = self._hashes(state)
        spans = hashes.saved_spans(skip, end)
        self.index.expect([h for h, _, _ in spans] + hashes.saved_aliases(skip, end), state.scope)
        self.events.expect(state.request, spans, state.scope)

    def spec(
        self,
        rid: str,
        state: RequestState,
        end: int,
        generation: str | None,
        step: int,
        *,
        expect: bool = True,
    ) -> SaveSpec | None:
        """The save step ``step``'s forward pass makes possible (tokens ``[0, end)`` have KV);
        the index is told what it will store unless ``expect`` is False."""
        spec = self.plan(rid, state, end, generation)
        if spec is not None:
            state.last_save_step = step
            if expect and len(spec.tokens) <= len(state.prompt):
                self.expect(state, spec.skip, len(spec.tokens))
        return spec

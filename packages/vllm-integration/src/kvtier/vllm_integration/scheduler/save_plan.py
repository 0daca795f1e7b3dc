"""Which tokens of a request a save stores, decided on the scheduler side.

Mid-prefill, the full chunks computed so far; once the prompt is computed, the whole prompt
(the engine stores its block-aligned tail as tail blocks with ``save_unfull_chunk``); with
``save_decode_cache``, chunks filled by generated tokens too. ``store_threshold`` cuts a save
to the chunks enough requests contained. A save never repeats what an earlier one (or the
request's load) already covered (``TrackedRequest.saved_upto``).
"""

from __future__ import annotations

from kvtier.core.config import KVTierConfig
from kvtier.vllm_integration.identity import identity_tokens
from kvtier.vllm_integration.messages import SaveSpec
from kvtier.vllm_integration.scheduler.events import EventLog
from kvtier.vllm_integration.scheduler.index import PresenceIndex
from kvtier.vllm_integration.scheduler.prompts import Sightings
from kvtier.vllm_integration.scheduler.request_state import SaveProgress, TrackedRequest


class SavePlanner:
    """Turns "tokens ``[0, end)`` of this request have KV" into the ``SaveSpec`` to send."""

    def __init__(
        self,
        config: KVTierConfig,
        block_size: int,
        sightings: Sightings,
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

    @property
    def step(self) -> int:
        """The granularity the engine stores at: blocks with tail blocks, else chunks."""
        return self.block_size if self.config.save_unfull_chunk else self.chunk_size

    def plan(
        self, req: TrackedRequest, end: int, generation: str | None
    ) -> tuple[SaveSpec | None, SaveProgress | None]:
        """The save tokens ``[0, end)`` make possible (None: nothing new to store), and the
        request's save progress after it (None: unchanged)."""
        request = req.request
        if not req.cacheable or req.generation != generation:
            return None, None
        prompt_len = request.num_prompt_tokens
        c = self.chunk_size
        prompt_saved = req.prompt_saved
        if end < prompt_len:
            save_end = end // c * c  # mid-prefill: full chunks only
        elif not prompt_saved:
            prompt_saved = True
            save_end = prompt_len  # the engine stores the block-aligned tail as a partial chunk
            if self.config.save_decode_cache:
                save_end = max(save_end, min(end, len(request.all_token_ids)) // c * c)
        elif self.config.save_decode_cache:
            save_end = min(end, len(request.all_token_ids)) // c * c
        else:
            return None, None
        if self.sightings.threshold > 1 and save_end <= len(req.prompt):
            # Only chunks enough requests contained (store_threshold).
            save_end = min(save_end, self.sightings.storable(req.hashes))
        # Nothing the engine would store (whole chunks, or blocks with save_unfull_chunk) means
        # no save, so no blocks are held.
        unchanged = SaveProgress(req.saved_upto, prompt_saved)
        if save_end - save_end % self.step <= req.saved_upto:
            return None, unchanged
        skip = req.saved_upto // c * c
        progress = SaveProgress(save_end, prompt_saved)
        if req.live_from > skip:
            # A hybrid model's window blocks before it are freed: those chunks cannot be stored.
            skip = -(-req.live_from // c) * c
            if skip >= save_end:
                return None, progress
        n_blocks = -(-save_end // self.block_size)
        if save_end <= len(req.prompt):
            tokens = req.prompt[:save_end]
        else:
            tokens = identity_tokens(request, request.all_token_ids[:save_end])
        spec = SaveSpec(req.rid, tokens, list(req.block_ids[:n_blocks]), skip, req.scope)
        return spec, progress

    def expect(self, req: TrackedRequest, skip: int, end: int, step: int) -> None:
        """Tell the index (and the KV event log) what a save asked for in scheduler step
        ``step`` will store: its chunks and tail blocks, and the aliases of its full chunks (a
        prompt diverging inside one of them hits its first blocks)."""
        assert self.index is not None and self.events is not None, "not bound to an index"
        hashes = req.hashes
        spans = hashes.saved_spans(skip, end)
        self.index.expect(
            [h for h, _, _ in spans] + hashes.saved_aliases(skip, end), req.scope, step
        )
        self.events.expect(req.request, spans, req.scope)

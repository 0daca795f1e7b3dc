"""The scheduler half of ``KVTierConnector`` (EngineCore process, next to vLLM's scheduler).

``get_num_new_matched_tokens`` asks the worker(s) over the lookup channel (``channel.py``) how
long a prefix of the prompt kvtier holds in any tier, including the worker's host memory; the
hit is cut to whole blocks and at most ``n - 1`` tokens (the last prompt token is always
recomputed, to produce the first logits). A channel failure or timeout is a miss. The worker
answers with a *hold* (``holds.py``): the hit chunks stay in its host memory until the load, so
what the scheduler was told is what gets loaded. The lookup names the request and a ``hold_id``
the scheduler picks; every later decision about that hold (load it, or drop it because vLLM will
not load: no external tokens allocated, request finished or aborted) reaches the worker in the
next step's metadata. ``build_connector_meta`` turns the step's schedule into loads (tokens vLLM
must not compute), hold releases and saves (chunks completed by this step's forward pass).

Every lookup, load and save is keyed by the request's identity (``identity.py``): its scope
(salt, LoRA adapter, weights generation) and its identity tokens (multimodal placeholders
replaced by content-derived ids). Prompt-embedding requests are neither looked up nor saved.
With ``load_async`` (the default; not with ``use_layerwise``) a hit is loaded while vLLM runs
other requests: the lookup answers ``load_async=True``, vLLM parks the request in
WAITING_FOR_REMOTE_KVS with its blocks allocated, and the load goes to the workers in the next
step's metadata without the request being scheduled; it runs on a worker thread and is reported
in ``get_finished``.

``reset_cache`` starts a new weights generation: chunks of the old weights are never served
again, and requests running across the reset save nothing more (their KV mixes generations).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import KeyScope
from kvtier.vllm_integration.channel import ChannelError, LookupClient, socket_path
from kvtier.vllm_integration.identity import (
    adapter_identity,
    cacheable,
    identity_tokens,
)
from kvtier.vllm_integration.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.vllm_integration.stats import KVTierStats, StatsTracker

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier")

HOLD_TTL_MIN_S = 30.0


def hold_ttl_s(config: KVTierConfig) -> float:
    """How long the worker keeps a lookup's hold with no lookup or load: 10x
    ``lookup_timeout_s``, at least 30 s. A load normally follows its lookup within a step, and a
    waiting request's repeated lookups refresh its hold, so only a lost hold (a decision the
    worker never heard of) lives this long."""
    return max(HOLD_TTL_MIN_S, 10.0 * config.lookup_timeout_s)


@dataclass
class _Request:
    """What the scheduler side tracks for one live request."""

    request: Request
    adapter: str | None
    prompt: np.ndarray  # identity tokens of the prompt
    generation: str | None  # the generation its KV is computed under
    block_ids: list[int] = field(default_factory=list)
    external: int = 0  # tokens to load in the request's next scheduled step
    hold_id: int | None = None  # the worker's hold those tokens are loaded from
    computed_at_lookup: int = 0  # tokens vLLM already had (its prefix cache) at the lookup
    load_async: bool = False  # what the last lookup answered
    saved_upto: int = 0  # tokens handed to the worker for saving
    prompt_saved: bool = False
    had_save: bool = False

    @property
    def scope(self) -> KeyScope:
        return KeyScope(self.request.cache_salt, self.adapter, self.generation)


class SchedulerSide:
    """Lookups, loads and saves decided on the scheduler (see the module docstring)."""

    def __init__(self, config: KVTierConfig, *, block_size: int, engine_id: str,
                 num_workers: int, load_failure_policy: str) -> None:
        self.config = config
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self._reqs: dict[str, _Request] = {}
        self._clients = [
            LookupClient(socket_path(engine_id, r), config.lookup_timeout_s)
            for r in range(num_workers)
        ]
        # Holds by request id that no load or release has consumed yet (see holds.py).
        self._hold_ids: dict[str, int] = {}
        self._next_hold_id = 0
        self._releases: list[tuple[str, int]] = []
        self._async_loads: list[LoadSpec] = []  # for the next step's metadata
        self._saving: set[str] = set()  # finished requests whose blocks wait for their saves
        self._load_async = config.load_async and not config.use_layerwise
        self.generation: str | None = None
        # Scheduler-process counters (the worker's are served over the lookup channel).
        self.stats = {"lookups": 0, "lookup_failures": 0, "hit_tokens": 0, "uncacheable": 0}
        # A request's last lookup: its hit (the minimum over ranks) and where each chunk was found
        # (rank 0's hold: ``[[start, end, tier], ...]``), for ``hit_sources``.
        self._hit_spans: dict[str, tuple[int, list[list[Any]]]] = {}
        self.metrics = StatsTracker()
        if load_failure_policy != "recompute":
            logger.warning(
                "kvtier: kv_load_failure_policy=%r: a load whose lookup hold expired (no load "
                "within %.0f s of the lookup) and whose chunks were evicted meanwhile fails the "
                "request; set kv_load_failure_policy='recompute' to recompute it instead",
                load_failure_policy, hold_ttl_s(config),
            )

    def _state(self, request: Request) -> _Request:
        state = self._reqs.get(request.request_id)
        if state is None:
            prompt = identity_tokens(request, request.prompt_token_ids or [])
            state = _Request(request, adapter_identity(request.lora_request), prompt,
                             self.generation)
            self._reqs[request.request_id] = state
        return state

    def _lookup(self, tokens: np.ndarray, scope: KeyScope, req_id: str, hold_id: int) -> int:
        """Tokens of ``tokens`` every rank holds (the minimum over ranks); 0 if any cannot say.

        Each rank keeps what it found as hold ``hold_id`` of ``req_id``; each holds at least the
        minimum, so the load of the reported hit reads only held chunks."""
        hit = len(tokens)
        spans: list[list[Any]] = []
        header = {"op": "lookup", "salt": scope.salt, "adapter": scope.adapter,
                  "generation": scope.generation, "req_id": req_id, "hold_id": hold_id}
        for client in self._clients:
            try:
                reply = client.call(header, tokens)
            except ChannelError as e:
                self.stats["lookup_failures"] += 1
                logger.warning("kvtier lookup failed, treating it as a miss: %s", e)
                return 0
            hit = min(hit, int(reply["hit"]))
            if client is self._clients[0]:
                spans = list(reply.get("sources") or [])
        self._hit_spans[req_id] = (hit, spans)
        return hit

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids
        if not prompt:
            return 0, False
        if not cacheable(request):
            self.stats["uncacheable"] += 1
            return 0, False
        n = len(prompt)
        bs = self.block_size
        most = (n - 1) // bs * bs  # the last prompt token is always recomputed
        if most <= num_computed_tokens:
            return 0, False
        self.stats["lookups"] += 1
        state = self._state(request)
        if state.generation != self.generation:
            return 0, False  # it started under older weights: nothing of theirs is served
        rid = request.request_id
        hold_id = self._hold_ids.get(rid)
        if hold_id is None:
            hold_id = self._hold_ids[rid] = self._next_hold_id
            self._next_hold_id += 1
        hit = self._lookup(state.prompt, state.scope, rid, hold_id)
        hit = min(hit, most)
        hit -= hit % bs
        new = max(0, hit - num_computed_tokens)
        self.stats["hit_tokens"] += new
        state.computed_at_lookup = num_computed_tokens
        state.load_async = self._load_async and new > 0
        return new, state.load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._state(request)
        hold_id = self._hold_ids.pop(request.request_id, None)
        if not num_external_tokens:
            state.external = 0
            if hold_id is not None:
                self._releases.append((request.request_id, hold_id))
            return
        if not state.load_async:
            state.external, state.hold_id = num_external_tokens, hold_id
            return
        # Not scheduled until the load is reported: it goes out with the next step's metadata.
        start = state.computed_at_lookup
        end = start + num_external_tokens
        self._async_loads.append(LoadSpec(
            request.request_id, state.prompt, list(blocks.get_block_ids()[0]), start, end,
            state.scope, hold_id, load_async=True,
        ))
        state.external = 0
        state.saved_upto = max(state.saved_upto, end // self.chunk_size * self.chunk_size)

    def _save_spec(self, rid: str, state: _Request, end: int) -> SaveSpec | None:
        """The save this step's forward pass makes possible (tokens ``[0, end)`` have KV)."""
        req = state.request
        if not cacheable(req) or state.generation != self.generation:
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
        # What the engine will actually store: whole chunks, plus a block-aligned tail when
        # save_unfull_chunk is set. Nothing storable means no save, so no blocks are held.
        step = self.block_size if self.config.save_unfull_chunk else c
        if save_end - save_end % step <= state.saved_upto:
            return None
        skip = state.saved_upto // c * c
        state.saved_upto = save_end
        state.had_save = True
        n_blocks = -(-save_end // self.block_size)
        if save_end <= len(state.prompt):
            tokens = state.prompt[:save_end]
        else:
            tokens = identity_tokens(req, req.all_token_ids[:save_end])
        return SaveSpec(rid, tokens, list(state.block_ids[:n_blocks]), skip, state.scope)

    def _schedule(self, meta: KVTierMetadata, rid: str, computed: int, scheduled: int) -> None:
        state = self._reqs.get(rid)
        if state is None:
            return
        if state.external:
            end = computed
            start = end - state.external
            meta.loads.append(LoadSpec(rid, state.prompt, list(state.block_ids), start, end,
                                       state.scope, state.hold_id))
            state.hold_id = None
            # Everything before the loaded chunk's start is stored already.
            state.saved_upto = max(state.saved_upto, end // self.chunk_size * self.chunk_size)
            state.external = 0
        spec = self._save_spec(rid, state, computed + scheduled)
        if spec is not None:
            meta.saves.append(spec)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        meta = KVTierMetadata(preempted=set(scheduler_output.preempted_req_ids or ()),
                              releases=self._releases, generation=self.generation,
                              loads=self._async_loads)
        self._releases, self._async_loads = [], []
        for rid in meta.preempted:
            state = self._reqs.get(rid)
            if state is not None:
                # Its KV is gone; what was saved stays saved, the rest is saved again on resume.
                state.block_ids = []
                state.prompt_saved = False
                state.saved_upto = 0
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._schedule(meta, new.req_id, new.num_computed_tokens,
                           scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._reqs.get(rid)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            self._schedule(meta, rid, cached.num_computed_tokens[i],
                           scheduler_output.num_scheduled_tokens.get(rid, 0))
        return meta

    def request_finished(self, request: Request) -> bool:
        """Whether to keep the request's blocks until the worker's saves of it are done
        (``get_finished``). A hold still pending for the request is released through the next
        step's metadata."""
        rid = request.request_id
        state = self._reqs.pop(rid, None)
        self._hit_spans.pop(rid, None)
        hold_id = self._hold_ids.pop(rid, None)
        if hold_id is None and state is not None:
            hold_id = state.hold_id
        if hold_id is not None:
            self._releases.append((rid, hold_id))
        keep = state is not None and state.had_save
        if keep:
            self._saving.add(rid)
        return keep

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The tokens vLLM loads for ``request`` by the tier each came from (rank 0's hold at
        the last lookup): ``{tier name: tokens}``; tokens of no known tier under ``""``."""
        hit, spans = self._hit_spans.get(request.request_id, (0, []))
        # The loaded tokens end where the reported hit ends (see get_num_new_matched_tokens).
        end = min(hit, (len(request.prompt_token_ids or ()) - 1) // self.block_size * self.block_size)
        end -= end % self.block_size
        start = end - num_external_tokens
        out: dict[str, int] = {}
        for s, e, tier in spans:
            n = min(int(e), end) - max(int(s), start)
            if n > 0:
                out[str(tier)] = out.get(str(tier), 0) + n
        rest = num_external_tokens - sum(out.values())
        if rest > 0:
            out[""] = rest
        return out

    def get_kv_connector_stats(self) -> KVTierStats | None:
        """The scheduler's metrics changed since the last call (``stats.py``)."""
        return self.metrics.delta({"lookup_failures": {"": self.stats["lookup_failures"]}})

    def saves_finished(self, req_ids: set[str]) -> None:
        """The workers reported these requests' saves done (vLLM frees their blocks now)."""
        self._saving -= req_ids

    def has_pending_block_frees(self) -> bool:
        """Blocks of finished requests come back once their saves are copied off the device:
        vLLM waits for them instead of preempting a running request."""
        return bool(self._saving)

    def reset_cache(self) -> bool:
        """Start a new weights generation (after a weight update): no chunk stored so far is
        served again; the workers drop their host tier when the next step's metadata arrives,
        lower tiers' old chunks become unreachable and age out."""
        self.generation = os.urandom(8).hex()
        logger.info("kvtier: cache reset, new weights generation %s", self.generation)
        return True

    def shutdown(self) -> None:
        for client in self._clients:
            client.close()

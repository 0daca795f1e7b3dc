"""CacheEngine: the engine-facing API (lookup, store, retrieve) over a StorageManager.

Chunking (``kvtier.core.keys.spans``): a prompt is cut into full chunks of ``chunk_size`` tokens;
with ``save_unfull_chunk`` the tail after the last full chunk is also stored, one block per span,
each chained onto the previous key; every full chunk stored also gets alias entries for its
leading blocks (``kvtier.core.keys.aliases``). A lookup takes the run of full-chunk hits and then,
at the first full-chunk miss, every whole block there that a stored tail or alias holds: a
prompt hits every whole block it shares with a stored one, wherever they diverge.

Hashing: each call hashes its prompt once (``kvtier.core.keys.prompt.PromptHashes``, made by the
span planner) and hands those hashes to the spans, the hold check, the load plan and the store
writer.

Storing: ``kvtier.core.engine.store_writer`` plans which spans a store copies and commits them (with
their alias entries) once the copy is done; ``kvtier.core.engine.load_plan`` fetches a hit prefix's
objects (what a hold keeps) and builds a retrieve's transfers.

Holds: ``hold(tokens)`` looks a prompt up *and* keeps its hit objects in host memory (fetching
lower-tier hits now, like a prefetch) until the hold is released, so a load that follows the
lookup cannot come up short because a chunk was evicted in between.

Scopes: every method that takes ``scope`` accepts a bare cache salt or a ``KeyScope`` (salt,
adapter identity, weights generation); see ``kvtier.core.keys``.

Slot mappings: ``slot_mapping[i]`` is token ``i``'s slot in the paged cache, ``-1`` when the
engine does not hold it (store: the chunk cannot be saved) or does not want it (retrieve: the
engine already has it, or it is past what the engine asked for). kvtier moves whole pages
(``kvtier.core.platform.mover``), so a chunk's slots map whole blocks: each block's tokens are all -1 or
all in one cache block, in order (``kvtier.core.engine.slots.span_blocks``). A hybrid engine
(``KVLayout.groups``) takes one row of slots per KV cache group (``[groups, n]``): a chunk is
stored only where every group has its slots, and a load fills the slots any group has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.engine.load_plan import LoadPlanner
from kvtier.core.engine.slots import checked_slots
from kvtier.core.engine.sources import TierHits, chunk_sources
from kvtier.core.engine.states import StateEntries
from kvtier.core.engine.store_writer import AliasPlan, StorePlan, StoreWriter, release_all
from kvtier.core.errors import ClosedError, ConfigError, KVTierError
from kvtier.core.keys import ChunkKey, KeyFactory, Scope, TokenIds
from kvtier.core.keys.spans import SpanPlanner
from kvtier.core.layout import KVLayout
from kvtier.core.memory.handles import ChunkSpan, EngineStats, Hold, RetrieveJob
from kvtier.core.platform import Marker, Platform, get_platform
from kvtier.core.platform.mover import PageMover, Transfer
from kvtier.core.storage import StorageManager, storage_manager_for

GiB = 1 << 30


class CacheEngine:
    """Stores and retrieves the KV of token chunks for one engine (model, layout, rank)."""

    def __init__(
        self,
        config: KVTierConfig,
        layout: KVLayout,
        *,
        model: str,
        world_size: int = 1,
        rank: int = 0,
        platform: Platform | None = None,
        storage: StorageManager | None = None,
    ) -> None:
        if config.chunk_size % layout.block_tokens:
            raise ConfigError(
                "chunk_size",
                config.chunk_size,
                f"must be a multiple of the engine's block size {layout.block_tokens}",
            )
        self.config = config
        self.layout = layout
        self.chunk_size = config.chunk_size
        self.keys = KeyFactory(model, layout.fingerprint(), world_size, rank)
        self.platform = platform or get_platform(config.platform, config.plugins)
        if storage is None:
            nbytes = int(config.local_cpu_size_gb * GiB)
            try:
                arena = self.platform.create_arena(nbytes, pin_memory=config.pin_memory)
            except (RuntimeError, MemoryError) as e:  # torch's allocator says it as RuntimeError
                raise ConfigError(
                    "local_cpu_size_gb",
                    config.local_cpu_size_gb,
                    f"host memory of {nbytes} bytes cannot be allocated here: {e}",
                ) from None
            namespace = self.keys.key(b"").namespace()
            storage = storage_manager_for(config, arena, layout, namespace)
        self.storage = storage
        self.spans = SpanPlanner(
            self.keys,
            storage,
            chunk_size=self.chunk_size,
            block_size=layout.block_tokens,
            tails=config.save_unfull_chunk,
        )
        self.mover: PageMover | None = None
        self._closed = False
        self.stats = EngineStats()
        self._tier_hits = TierHits()
        self._writer = StoreWriter(storage, self.spans, layout, self.chunk_size, self.stats)
        self.states = (
            StateEntries(storage, self.keys, layout, self.chunk_size, self.stats)
            if layout.states
            else None
        )
        self._loads = LoadPlanner(storage, self.spans, layout, self.states, self.stats)

    # -- setup ---------------------------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: Sequence[torch.Tensor], num_blocks: int | None = None
    ) -> None:
        """Hand over the engine's per-layer KV views (once, before any transfer);
        ``num_blocks``: the cache's (manager) blocks, when the views count kernel blocks."""
        self._check_open()
        self.mover = self.platform.create_mover(
            kv_caches,
            self.layout,
            num_blocks=num_blocks,
            staging_buffer=self.config.device_staging_buffer,
        )

    def watch_stores(self, listener: Callable[[list[ChunkKey]], None]) -> None:
        """Call ``listener(keys)`` with the keys of the chunks every store commits, on the
        storing thread, after they are readable (the vLLM connector feeds its scheduler's index
        of stored chunks with it). It must be quick and must not raise."""
        self._writer.listeners.append(listener)

    def _require_mover(self) -> PageMover:
        if self.mover is None:
            raise KVTierError("register_kv_caches must be called before store/retrieve")
        return self.mover

    # -- chunking ------------------------------------------------------------------------------
    def full_spans(self, tokens: TokenIds, scope: Scope = None) -> list[ChunkSpan]:
        """The full chunks of ``tokens`` (``keys.prefix_hashes``)."""
        return self.spans.full(self.spans.prompt(tokens, scope))

    def tail_spans(self, tokens: TokenIds, index: int, scope: Scope = None) -> list[ChunkSpan]:
        """Block-sized spans after full chunk ``index - 1``: whole blocks of ``tokens`` up to one
        block short of a chunk, each keyed by chaining its block onto the previous key (a tail
        key never equals a full-chunk key: their hash inputs differ in length)."""
        return self.spans.tail(self.spans.prompt(tokens, scope), index)

    def hit_spans(self, tokens: TokenIds, scope: Scope = None) -> list[ChunkSpan]:
        """The contiguous run of stored spans covering a prefix of ``tokens`` (full chunks, then
        tail blocks or an alias into a stored chunk: ``kvtier.core.keys.spans``); with state groups,
        cut to the longest one ending at a stored state (``kvtier.core.engine.states``)."""
        prompt = self.spans.prompt(tokens, scope)
        hits = self.spans.hits(prompt)
        return self.states.cut(prompt, hits, fetch=False)[0] if self.states else hits

    def store_spans(self, tokens: TokenIds, scope: Scope = None) -> list[ChunkSpan]:
        """Spans ``store`` would save for ``tokens``: full chunks, then the tail block by block."""
        return self.spans.store(self.spans.prompt(tokens, scope))

    # -- API -----------------------------------------------------------------------------------
    def lookup(self, tokens: TokenIds, scope: Scope = None) -> int:
        """Number of leading tokens of ``tokens`` whose KV is stored (a multiple of the block size)."""
        self._check_open()
        hits = self.hit_spans(tokens, scope)
        n = hits[-1].end if hits else 0
        self.stats.add(lookups=1, lookup_hit_tokens=n)
        return n

    def hold(self, tokens: TokenIds, scope: Scope = None) -> Hold:
        """Look ``tokens`` up and keep the hit prefix's objects in host memory (see ``Hold``)."""
        self._check_open()
        prompt = self.spans.prompt(tokens, scope)
        hits, state, state_source = self.spans.hits(prompt), None, ""
        if self.states is not None:
            hits, state, state_source = self.states.cut(prompt, hits)
        try:
            sources = self.chunk_sources([s.key for s in hits])
            spans, objs = self._loads.fetch_prefix(hits)
        except BaseException:
            if state is not None:
                state[1].release()
            raise
        spans, objs, state = StateEntries.settle(spans, objs, state)
        hold = Hold(
            spans,
            objs,
            prompt.digest(spans[-1].end if spans else 0),
            sources=sources[: len(spans)],
            state=state,
            state_source=state_source if state is not None else "",
        )
        self.stats.add(lookups=1, lookup_hit_tokens=hold.num_tokens)
        self._tier_hits.count(spans, hold.sources)
        return hold

    def chunk_sources(self, keys: Sequence[ChunkKey]) -> list[str]:
        """The tier name holding each of ``keys`` (``kvtier.core.engine.sources.chunk_sources``)."""
        return chunk_sources(self.storage, keys)

    def hit_tokens_by_tier(self) -> dict[str, int]:
        """Tokens found by ``hold`` so far, by the tier that held each chunk."""
        return self._tier_hits.snapshot()

    def _slots(self, slot_mapping: torch.Tensor | Sequence[int], n_tokens: int) -> torch.Tensor:
        """``slot_mapping`` checked against the registered cache (``checked_slots``)."""
        return checked_slots(slot_mapping, n_tokens, self.num_slots(), self.layout.num_groups)

    def num_slots(self) -> list[int] | None:
        """Slots of the registered cache, per slot row (None before a cache is registered)."""
        m = self.mover
        return [m.num_blocks * b for b in self.layout.slot_block_sizes] if m else None

    def _plan_store(
        self, tokens: TokenIds, slot_mapping: torch.Tensor | Sequence[int], scope: Scope
    ) -> tuple[StorePlan, AliasPlan]:
        prompt = self.spans.prompt(tokens, scope)
        return self._writer.plan(prompt, self._slots(slot_mapping, len(prompt.arr)))

    def store(
        self,
        tokens: TokenIds,
        slot_mapping: torch.Tensor | Sequence[int],
        *,
        scope: Scope = None,
        ready: Marker = None,
        keep: Callable[[], bool] | None = None,
    ) -> int:
        """Save every storable span of ``tokens`` not already stored; returns tokens newly stored.

        A span is storable when all its slots (every group's) are valid (>= 0). Skipped silently when host
        memory is exhausted (counted in ``stats.store_skipped_chunks``).

        ``ready``: a marker from ``platform.record_marker()`` taken on the thread whose device
        work wrote this KV (vLLM's forward pass); the copy is ordered after it. Needed whenever
        ``store`` runs on another thread than the one that computed the KV: device work is
        ordered per stream, and another thread's current stream does not wait for the compute
        stream. ``keep``: asked once the copy is done; if it returns False the copied chunks
        are dropped, nothing is stored (the engine's blocks may have been reused meanwhile).
        """
        self._check_open()
        mover = self._require_mover()
        plan, aliases = self._plan_store(tokens, slot_mapping, scope)
        if not plan:
            return 0
        try:
            self.platform.wait_marker(ready)
            mover.store([t for _, t in plan])
        except BaseException:
            release_all([t.obj for _, t in plan])
            raise
        if keep is not None and not keep():
            release_all([t.obj for _, t in plan])
            self.stats.add(store_abandoned_chunks=len(plan))
            return 0
        return self._writer.commit(plan, aliases)

    def store_layerwise(
        self, tokens: TokenIds, slot_mapping: torch.Tensor | Sequence[int], *, scope: Scope = None
    ) -> Iterator[int]:
        """Like ``store``, one layer per ``next()``; the chunks are saved when it is exhausted."""
        self._check_open()
        mover = self._require_mover()
        plan, aliases = self._plan_store(tokens, slot_mapping, scope)
        try:
            if plan:
                yield from mover.store_layerwise([t for _, t in plan])
            else:
                yield from range(self.layout.num_layers)
        except BaseException:
            release_all([t.obj for _, t in plan])
            raise
        self._writer.commit(plan, aliases)

    def _plan_retrieve(
        self,
        tokens: TokenIds,
        slot_mapping: torch.Tensor | Sequence[int],
        scope: Scope,
        hold: Hold | None,
        state_blocks: Sequence[int] | None = None,
    ) -> tuple[list[Transfer], torch.Tensor]:
        prompt = self.spans.prompt(tokens, scope)
        cpu_slots = self._slots(slot_mapping, len(prompt.arr)).cpu()
        return self._loads.plan(prompt, cpu_slots, hold, state_blocks)

    def retrieve(
        self,
        tokens: TokenIds,
        slot_mapping: torch.Tensor | Sequence[int],
        *,
        scope: Scope = None,
        hold: Hold | None = None,
        ready: Marker = None,
        state_blocks: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Load the stored prefix of ``tokens`` into the slots that are not -1.

        With ``hold`` (from ``hold(tokens, scope)``), load exactly the held objects (the hold stays
        the caller's to release). Returns a bool mask (one per token) of the tokens whose KV was
        written into the cache. ``ready``: as for ``store`` (a load issued on another thread
        must not overwrite blocks that earlier device work on the compute stream still reads).
        ``state_blocks``: with state groups (``KVLayout.states``), the cache block of each state
        group that takes the state at the end of the loaded tokens; the whole load is skipped
        (an all-False mask) when that state is not stored.
        """
        self._check_open()
        mover = self._require_mover()
        transfers, mask = self._plan_retrieve(tokens, slot_mapping, scope, hold, state_blocks)
        try:
            if transfers:
                self.platform.wait_marker(ready)
                mover.load(transfers)
        finally:
            release_all([t.obj for t in transfers])
        self.stats.add(retrieved_tokens=int(mask.sum()))
        return mask

    def retrieve_layerwise(
        self,
        tokens: TokenIds,
        slot_mapping: torch.Tensor | Sequence[int],
        *,
        scope: Scope = None,
        hold: Hold | None = None,
    ) -> RetrieveJob:
        """Fetch the stored prefix now; load it layer by layer as the job's ``layers`` is iterated."""
        self._check_open()
        mover = self._require_mover()
        transfers, mask = self._plan_retrieve(tokens, slot_mapping, scope, hold)

        def layers() -> Iterator[int]:
            try:
                if transfers:
                    yield from mover.load_layerwise(transfers)
                else:
                    yield from range(self.layout.num_layers)
            finally:
                release_all([t.obj for t in transfers])
            self.stats.add(retrieved_tokens=int(mask.sum()))

        return RetrieveJob(mask, layers())

    def store_state(
        self,
        tokens: TokenIds,
        boundary: int,
        blocks: Sequence[int],
        *,
        scope: Scope = None,
        ready: Marker = None,
        keep: Callable[[], bool] | None = None,
    ) -> bool:
        """Store the recurrent state after the first ``boundary`` tokens (a full-chunk boundary)
        from ``blocks``, one cache block per state group (``kvtier.core.engine.states``); whether a
        new entry was stored. ``ready``, ``keep``: as for ``store``."""
        self._check_open()
        if self.states is None:
            raise KVTierError("store_state needs a layout with state groups (KVLayout.states)")
        mover = self._require_mover()
        prompt = self.spans.prompt(tokens, scope)
        return self.states.store(prompt, boundary, blocks, mover, self.platform, ready, keep)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this kvtier CacheEngine is closed: the call came after close()")

    def close(self) -> None:
        self._closed = True
        self.storage.close()
        arena = getattr(self.storage, "arena", None)
        if arena is not None:
            arena.close()

"""The write side of ``CacheEngine.store``: which spans of a prompt to copy out of the paged
cache into new host objects (``StoreWriter.plan``), and, once the device copy is done, putting
them into storage with the alias entries of each full chunk (``StoreWriter.commit``).

A plan's host objects are the caller's until ``commit`` (or ``release_all``, when the copy
fails or is abandoned): ``commit`` hands each one to storage and releases what is left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from kvtier.core.engine.slots import complete, span_rows
from kvtier.core.keys import ChunkKey
from kvtier.core.keys.aliases import Alias, alias_objects
from kvtier.core.keys.prompt import PromptHashes
from kvtier.core.keys.spans import SpanPlanner
from kvtier.core.layout import KVLayout
from kvtier.core.memory import MemoryObj, MemoryObjMeta
from kvtier.core.memory.handles import ChunkSpan, EngineStats
from kvtier.core.platform.mover import Transfer
from kvtier.core.storage import StorageManager
from kvtier.core.warn import warn_throttled

logger = logging.getLogger("kvtier")

# The alias entries to write with each full chunk a store commits (by the chunk's key).
AliasPlan = dict[ChunkKey, list[tuple[ChunkKey, Alias]]]
StorePlan = list[tuple[ChunkSpan, Transfer]]


def release_all(objs: Sequence[MemoryObj]) -> None:
    """Release every object of ``objs`` not released yet."""
    for obj in objs:
        if not obj.released:
            obj.release()


class StoreWriter:
    """Plans and commits the stores of one engine (its layout, chunk size and storage)."""

    def __init__(
        self,
        storage: StorageManager,
        spans: SpanPlanner,
        layout: KVLayout,
        chunk_size: int,
        stats: EngineStats,
    ) -> None:
        self.storage = storage
        self.spans = spans
        self.layout = layout
        self.chunk_size = chunk_size
        self.stats = stats
        self.listeners: list[Callable[[list[ChunkKey]], None]] = []

    def _meta(self, num_tokens: int) -> MemoryObjMeta:
        return MemoryObjMeta(
            self.layout.chunk_shape(num_tokens), self.layout.chunk_dtype, num_tokens
        )

    def plan(self, prompt: PromptHashes, slots: torch.Tensor) -> tuple[StorePlan, AliasPlan]:
        """The spans of the prompt to copy out of the cache now (those whose ``slots`` are all
        valid and that storage does not hold yet), each with a new host object, and the alias
        entries of each full chunk among them (written at commit)."""
        cpu_slots = slots.cpu()
        every = self.spans.store(prompt)
        spans = [s for s in every if bool(complete(cpu_slots[..., s.start : s.end]).all())]
        if not spans:
            return [], {}
        # Checked before anything is allocated: a bad mapping raises with nothing to release.
        bs = self.layout.slot_block_sizes
        blocks = {s.key: span_rows(cpu_slots, s.start, s.end, bs) for s in spans}
        present = self.storage.contains([s.key for s in spans])
        plan: StorePlan = []
        aliases: AliasPlan = {}
        for span, have in zip(spans, present, strict=True):
            if have:
                continue
            obj = self.storage.allocate(self._meta(span.num_tokens))
            if obj is None:
                skipped = len(spans) - len(plan)
                self.stats.add(store_skipped_chunks=skipped)
                arena = getattr(self.storage, "arena", None)
                if arena is not None and arena.capacity < arena.target_bytes:
                    # Not full: the arena is still being set up (pinned segment by segment).
                    logger.debug(
                        "kvtier host memory is still growing (%d of %d bytes ready): %d "
                        "chunk(s) not stored",
                        arena.capacity,
                        arena.target_bytes,
                        skipped,
                    )
                else:
                    warn_throttled(
                        "host-full", "kvtier host memory is full: %d chunk(s) not stored", skipped
                    )
                break
            plan.append((span, Transfer(obj, blocks[span.key])))
            if span.num_tokens == self.chunk_size:
                aliases[span.key] = self.spans.aliases(prompt, span.start // self.chunk_size)
        return plan, aliases

    def commit(self, plan: Sequence[tuple[ChunkSpan, Transfer]], aliases: AliasPlan) -> int:
        """Put every copied span (and its alias entries) into storage, then tell the
        listeners the keys; returns the tokens stored."""
        stored = 0
        keys: list[ChunkKey] = []
        for span, t in plan:
            entries, skipped = alias_objects(aliases.get(span.key, ()), self.storage.allocate)
            if skipped:
                self.stats.add(aliases_skipped=skipped)
            try:
                with t.obj:
                    self.storage.put_with_aliases(span.key, t.obj, entries)
            finally:
                release_all([obj for _, obj in entries])
            stored += span.num_tokens
            keys.append(span.key)
            keys.extend(k for k, _ in entries)
        self.stats.add(stored_tokens=stored)
        for listener in self.listeners:
            listener(keys)
        return stored

"""Recurrent-state entries: a Mamba / linear-attention hybrid model's state at a chunk boundary.

Such a model (vLLM's hybrid memory allocator with ``mamba_cache_mode="align"``) keeps no KV for
its Mamba layers: one recurrent state per request, held in one block of each Mamba group, in
the same tensors as the attention groups' pages (the state in the first bytes of that block's
page, ``KVLayout.states``). A prefix of ``P`` tokens can be skipped only with the attention
pages of ``[0, P)`` *and* the state after exactly ``P`` tokens, and vLLM has that state only
where a prefill step ended.

So kvtier stores the two apart. Chunks hold the attention groups' pages, as for any model; a
*state entry* holds, for a prefix ending at a full-chunk boundary ``P``, one block of every
state group (``[groups, layers, page]`` bytes, ``KVLayout.state_shape``) under
``KeyFactory.state_key`` of the prefix's hash at ``P``. It is written only from a block vLLM
says holds the state at ``P`` (its boundary-state offers), never found by position. A hit of
such a model is the longest full-chunk prefix ``P`` (before the prompt's last token) whose
chunks are stored *and* that has a state entry at ``P``; a load fills the attention pages of
the hit and the state into the block vLLM gives for it, or nothing at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvtier.core.engine.slots import written
from kvtier.core.engine.sources import chunk_sources
from kvtier.core.engine.store_writer import release_all
from kvtier.core.keys import ChunkKey, KeyFactory
from kvtier.core.keys.prompt import PromptHashes
from kvtier.core.layout import KVLayout
from kvtier.core.memory import MemoryObj, MemoryObjMeta
from kvtier.core.memory.handles import ChunkSpan, EngineStats
from kvtier.core.platform import Marker, Platform
from kvtier.core.platform.mover import PageMover, Transfer
from kvtier.core.storage import StorageManager


class StateEntries:
    """The state entries of one engine (module docstring)."""

    def __init__(
        self,
        storage: StorageManager,
        keys: KeyFactory,
        layout: KVLayout,
        chunk_size: int,
        stats: EngineStats,
    ) -> None:
        self.storage = storage
        self.keys = keys
        self.layout = layout
        self.chunk_size = chunk_size
        self.stats = stats
        self.meta = MemoryObjMeta(layout.state_shape, layout.chunk_dtype, layout.block_size)

    def key(self, prompt: PromptHashes, boundary: int) -> ChunkKey:
        """The key of the state after the prompt's first ``boundary`` tokens (a full-chunk
        boundary within the prompt: a ``ValueError`` otherwise)."""
        c = self.chunk_size
        if boundary <= 0 or boundary % c or boundary > len(prompt.arr):
            raise ValueError(
                f"a state entry ends at a full chunk of {c} tokens within the prompt "
                f"({len(prompt.arr)} tokens), not at token {boundary}"
            )
        return self.keys.state_key(prompt.full[boundary // c - 1], prompt.scope)

    def _get(self, key: ChunkKey) -> MemoryObj | None:
        obj = self.storage.get(key)
        if obj is not None and obj.meta.shape != self.meta.shape:
            obj.release()  # not a state of this layout: a miss
            return None
        return obj

    def cut(
        self, prompt: PromptHashes, hits: list[ChunkSpan], *, fetch: bool = True
    ) -> tuple[list[ChunkSpan], tuple[int, MemoryObj] | None, str]:
        """``hits`` (a run from token 0) cut to the longest full-chunk prefix ``P`` before the
        prompt's last token (the engine computes at least one token to continue from it) that
        has a state entry, that entry (``(P, object)``, the caller's to release) and the tier
        it was read from; ``([], None, "")`` when there is none. ``fetch`` False asks the tiers
        for presence only (a lookup's estimate: no state is read, None in its place)."""
        c, limit = self.chunk_size, len(prompt.arr) - 1
        ends = [s.end for s in hits if s.num_tokens == c and s.end % c == 0 and s.end <= limit]
        if not ends:
            return [], None, ""
        keys = [self.key(prompt, e) for e in ends]
        present = self.storage.contains(keys)
        for i in reversed(range(len(ends))):
            if not present[i]:
                continue
            cut = [s for s in hits if s.end <= ends[i]]
            if not fetch:
                return cut, None, ""
            (source,) = chunk_sources(self.storage, [keys[i]])
            obj = self._get(keys[i])
            if obj is not None:
                return cut, (ends[i], obj), source
        return [], None, ""

    @staticmethod
    def settle(
        spans: list[ChunkSpan], objs: list[MemoryObj], state: tuple[int, MemoryObj] | None
    ) -> tuple[list[ChunkSpan], list[MemoryObj], tuple[int, MemoryObj] | None]:
        """A hold's fetched chunks and the state it was cut to: nothing at all (everything
        released) when a chunk went missing since the cut, as there is no hit without its
        state."""
        if state is not None and (not spans or spans[-1].end != state[0]):
            state[1].release()
            release_all(objs)
            return [], [], None
        return spans, objs, state

    def load(
        self,
        prompt: PromptHashes,
        boundary: int,
        blocks: Sequence[int],
        held: tuple[int, MemoryObj] | None,
    ) -> Transfer | None:
        """A transfer of the state at ``boundary`` into ``blocks`` (one cache block per state
        group): from ``held`` when it is that state, else read from storage now; None when it
        is not stored."""
        if len(blocks) != self.meta.shape[0] or min(blocks, default=-1) < 0:
            raise ValueError(
                f"a state load needs one cache block for each of the {self.meta.shape[0]} "
                f"state group(s), got {list(blocks)}"
            )
        if held is not None and held[0] == boundary:
            obj: MemoryObj | None = held[1].share()
        else:
            obj = self._get(self.key(prompt, boundary))
        if obj is None:
            self.stats.add(state_misses=1)
            return None
        return Transfer(obj, torch.tensor(list(blocks), dtype=torch.long))

    def with_state(
        self,
        prompt: PromptHashes,
        cpu_slots: torch.Tensor,
        transfers: list[Transfer],
        mask: torch.Tensor,
        held: tuple[int, MemoryObj] | None,
        state_blocks: Sequence[int] | None,
    ) -> tuple[list[Transfer], torch.Tensor]:
        """A load's chunk ``transfers`` (writing ``mask``) and the state at the end of the
        wanted tokens (``cpu_slots``), or nothing (an all-False mask; the transfers' objects
        released): attention pages without their state are of no use, and a state must never
        be left half-loaded. ``state_blocks`` None (vLLM gave no block for it) loads nothing."""
        want = written(cpu_slots)
        wanted = want.nonzero()
        end = int(wanted[-1]) + 1 if wanted.numel() else 0
        state = None
        try:
            complete = bool(mask[:end][want[:end]].all())
            if state_blocks is not None and end % self.chunk_size == 0 and complete:
                state = self.load(prompt, end, state_blocks, held)
        except BaseException:
            release_all([t.obj for t in transfers])
            raise
        if state is None:
            release_all([t.obj for t in transfers])
            return [], torch.zeros_like(mask)
        return [*transfers, state], mask

    def store(
        self,
        prompt: PromptHashes,
        boundary: int,
        blocks: Sequence[int],
        mover: PageMover,
        platform: Platform,
        ready: Marker,
        keep: Callable[[], bool] | None = None,
    ) -> bool:
        """Copy the state at ``boundary`` out of ``blocks`` (one per state group) and store
        it, unless it is stored already; whether a new entry was stored. ``ready`` and
        ``keep`` as for ``CacheEngine.store``."""
        key = self.key(prompt, boundary)
        if self.storage.contains([key])[0]:
            return False
        obj = self.storage.allocate(self.meta)
        if obj is None:
            self.stats.add(store_skipped_chunks=1)
            return False
        transfer = Transfer(obj, torch.tensor(list(blocks), dtype=torch.long))
        try:
            platform.wait_marker(ready)
            mover.store([transfer])
        except BaseException:
            obj.release()
            raise
        if keep is not None and not keep():
            obj.release()
            self.stats.add(store_abandoned_chunks=1)
            return False
        with obj:
            self.storage.put(key, obj)
        self.stats.add(stored_states=1)
        return True

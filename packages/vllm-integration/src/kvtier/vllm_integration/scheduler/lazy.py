"""Lazy offload (``offload: lazy``): copy a finished request's chunks off the device only when
vLLM is about to evict their blocks from its prefix cache.

With vLLM's prefix cache on, a finished request's blocks stay cached on the device (vLLM's
free queue, least recently used first) until vLLM reuses them. Eager offload copies every
computed chunk at once; lazy offload remembers, per finished request, the save eager would
have made (tokens, kvtier keys through the request's scope, block ids) and vLLM's block hash
of each of those blocks. Each scheduler step it walks the head of vLLM's free queue (the blocks
vLLM evicts next: ``2 * ceil(max_num_batched_tokens / block_size)``, as vLLM's own
SimpleCPUOffloadConnector does), and for every remembered request with a block there:

- it checks that the blocks still carry the block hashes they had at finish: a block vLLM has
  reused (evicted, then filled with other KV) has another hash or none, and the save is cut
  before the first such block (whole chunks, or blocks with ``save_unfull_chunk``), so a
  reused block is never stored;
- it *touches* the blocks it will read (vLLM's ``BlockPool.touch``: reference count up, out of
  the free queue), so vLLM cannot reuse them while the worker copies;
- it sends the save through the normal save path (the worker's saver thread, then the lower
  tiers), and frees the blocks (``BlockPool.free_blocks``) once every worker reported the copy
  done (``LazyWorkerMeta``).

vLLM frees a finished request's blocks after the step that finished it, and the next step
allocates before the walk: when fewer blocks than the window are free at that moment, the new
blocks would be among the next evicted at once, so their save starts right away (touched in
``request_finished``, before vLLM frees them).

A prompt that vLLM keeps cached until it is used again moves no bytes. A request preempted
before it finished is not remembered (its blocks are in vLLM's prefix cache; if vLLM evicts them
before the request resumes, they are recomputed, as without kvtier).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvtier.vllm_integration.messages import SaveSpec

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

logger = logging.getLogger("kvtier")

CAPACITY = 8192  # finished requests remembered at most (the oldest are forgotten)
# Blocks remembered at most, as a multiple of vLLM's cache: saves of more blocks than the cache
# holds are of blocks vLLM has reused since, so the oldest are forgotten (bounds the memory the
# remembered prompts take).
CACHE_MULTIPLE = 2


def target_blocks(max_num_batched_tokens: int, block_size: int) -> int:
    """How many blocks at the head of vLLM's free queue are "about to be evicted": twice what
    one step can allocate (vLLM's SimpleCPUOffloadConnector uses the same watermark)."""
    return 2 * -(-max_num_batched_tokens // block_size)


@dataclass(eq=False)
class _Candidate:
    """A finished request's save, waiting for its blocks to near eviction."""

    spec: SaveSpec  # the save eager offload would have made at finish
    hashes: list[Any]  # vLLM's block hash of each full block of spec.tokens
    step: int  # what the engine stores: chunk_size, or block_size with tail blocks
    owner: Any  # the caller's state for the request (returned with the save)


@dataclass
class _InFlight:
    blocks: list[KVCacheBlock]
    ranks: set[int] = field(default_factory=set)


class LazyOffload:
    """Remembered saves of finished requests, and the touched blocks of those being copied."""

    def __init__(self, block_size: int, target: int, num_workers: int) -> None:
        self.block_size = block_size
        self.target = target
        self.num_workers = num_workers
        self.pool: BlockPool | None = None
        self._cands: OrderedDict[int, _Candidate] = OrderedDict()
        self._by_block: dict[int, set[int]] = {}  # block id -> candidates reading it
        self._next = 0
        self._inflight: dict[str, _InFlight] = {}  # lazy save id -> its touched blocks
        self._started: list[tuple[SaveSpec, Any]] = []  # touched, not yet sent to the workers
        self._blocks = 0  # blocks watched by remembered saves
        self.stats = {
            "lazy_saves": 0,
            "lazy_reused_blocks": 0,
            "lazy_dropped": 0,
            "lazy_forgotten": 0,
        }

    def bind(self, pool: BlockPool) -> None:
        self.pool = pool

    @property
    def remembered(self) -> int:
        """Finished requests whose saves wait for their blocks to near eviction."""
        return len(self._cands)

    @property
    def pending(self) -> bool:
        """Blocks are touched for a copy still running (vLLM gets them back soon)."""
        return bool(self._inflight)

    def remember(self, spec: SaveSpec, step: int, owner: Any) -> None:
        """Keep ``spec`` (a finished request's save) until its blocks near eviction. Only the
        leading blocks vLLM has cached (a block hash) are remembered."""
        pool = self._require_pool()
        bs = self.block_size
        hashes: list[Any] = []
        for i in range(len(spec.tokens) // bs):
            h = pool.blocks[spec.block_ids[i]].block_hash if i < len(spec.block_ids) else None
            if h is None:
                break
            hashes.append(h)
        end = len(hashes) * bs
        if end < len(spec.tokens):
            spec = replace(spec, tokens=spec.tokens[:end], block_ids=spec.block_ids[: len(hashes)])
        if len(spec.tokens) - len(spec.tokens) % step <= spec.skip:
            return
        cid = self._next
        self._next += 1
        self._cands[cid] = _Candidate(spec, hashes, step, owner)
        for b in spec.block_ids[spec.skip // bs :]:
            self._by_block.setdefault(b, set()).add(cid)
        self._blocks += len(spec.block_ids) - spec.skip // bs
        limit = CACHE_MULTIPLE * pool.num_gpu_blocks
        while len(self._cands) > CAPACITY or (self._blocks > limit and len(self._cands) > 1):
            self._forget(next(iter(self._cands)))
            self.stats["lazy_forgotten"] += 1
        if pool.get_num_free_blocks() < self.target:
            # vLLM frees these blocks after this call, into a free queue shorter than the
            # window: the next step could allocate them before its walk. Take them now.
            self._start(cid)

    def _require_pool(self) -> BlockPool:
        if self.pool is None:
            raise RuntimeError(
                "kvtier: offload=lazy needs vLLM's block pool (bind_gpu_block_pool), which this "
                "vLLM did not bind; use offload=eager"
            )
        return self.pool

    def _forget(self, cid: int) -> _Candidate:
        cand = self._cands.pop(cid)
        self._blocks -= len(cand.spec.block_ids) - cand.spec.skip // self.block_size
        for b in cand.spec.block_ids[cand.spec.skip // self.block_size :]:
            users = self._by_block.get(b)
            if users is not None:
                users.discard(cid)
                if not users:
                    del self._by_block[b]
        return cand

    def _intact(self, cand: _Candidate) -> SaveSpec | None:
        """The candidate's save cut before its first block vLLM has reused since (None if
        nothing before it is left to store)."""
        pool = self._require_pool()
        spec, bs = cand.spec, self.block_size
        cut = len(spec.tokens)
        for i in range(spec.skip // bs, len(cand.hashes)):
            if pool.blocks[spec.block_ids[i]].block_hash != cand.hashes[i]:
                cut = i * bs
                self.stats["lazy_reused_blocks"] += 1
                break
        cut -= cut % cand.step
        if cut <= spec.skip:
            return None
        if cut == len(spec.tokens):
            return spec
        return replace(spec, tokens=spec.tokens[:cut], block_ids=spec.block_ids[: -(-cut // bs)])

    def due(self) -> list[tuple[SaveSpec, Any]]:
        """The saves to send this step, each with its owner; their blocks are touched."""
        if self.pool is None or not self._by_block:
            out, self._started = self._started, []
            return out
        pool = self.pool
        near: list[int] = []
        for covered, block in enumerate(pool.free_block_queue.iter_blocks_after(None)):
            if covered >= self.target:
                break
            near.extend(self._by_block.get(block.block_id, ()))
        for cid in dict.fromkeys(near):
            self._start(cid)
        out, self._started = self._started, []
        return out

    def _start(self, cid: int) -> None:
        """Touch the candidate's intact blocks and queue its save for the next step."""
        pool = self._require_pool()
        cand = self._forget(cid)
        spec = self._intact(cand)
        if spec is None:
            self.stats["lazy_dropped"] += 1
            return
        lazy_id = f"kvtier-lazy-{cid}"
        blocks = [pool.blocks[b] for b in spec.block_ids[spec.skip // self.block_size :]]
        pool.touch(blocks)
        self._inflight[lazy_id] = _InFlight(blocks)
        self.stats["lazy_saves"] += 1
        self._started.append((replace(spec, req_id=lazy_id), cand.owner))

    def copied(self, rank: int, lazy_ids: list[str]) -> None:
        """Worker ``rank`` finished copying these saves; blocks go back once every rank did."""
        for lazy_id in lazy_ids:
            flight = self._inflight.get(lazy_id)
            if flight is None:
                continue
            flight.ranks.add(rank)
            if len(flight.ranks) >= self.num_workers:
                del self._inflight[lazy_id]
                # Tail blocks first: the order vLLM frees a request's blocks in.
                self._require_pool().free_blocks(reversed(flight.blocks))

    def clear(self) -> None:
        """Forget every remembered save (a new weights generation: their KV is stale). Saves
        already started still run; their chunks carry the old generation's keys."""
        self._cands.clear()
        self._by_block.clear()
        self._blocks = 0

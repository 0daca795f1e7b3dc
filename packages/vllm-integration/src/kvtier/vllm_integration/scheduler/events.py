"""KV events for routers: ``BlockStored`` / ``BlockRemoved`` for what kvtier's tiers hold.

vLLM publishes its own KV events (``--kv-events-config``, a ZMQ publisher) for the blocks in its
device cache; routers (llm-d, Dynamo, production-stack) route on them. kvtier adds events for
its tiers through the connector's ``take_events`` (the scheduler publishes them with vLLM's
own). They carry the block hashes vLLM itself gives those blocks (``Request.block_hashes``, the
hashes a router computes for the same prompt), the blocks' token ids, LoRA name,
``ownership="kvtier"`` and the medium: ``CPU`` (host memory), ``DISK`` (local disk), ``REDIS``.

- ``BlockStored`` when a chunk lands in a tier (the worker's report after the save commits to
  host memory, or after the lower-tier write, which is asked whether it kept the chunk);
- ``BlockRemoved`` when a tier that can tell drops it (host memory, disk; Redis evicts on its
  own and cannot tell);
- one event per chunk (a chunk covers ``chunk_size / block_size`` blocks), for rank 0's shard;
  for a hybrid model (several KV cache groups, ``groups.py``) one per chunk and group, with the
  group's index, spec kind and window, as vLLM's own hybrid events (a chunk holds every
  group's pages of its blocks); where the groups' blocks differ in size (Gemma 4), each
  group's event names its own blocks, by the hash vLLM gives a block of that size (the
  request's hash at the block's last ``hash_block_size`` boundary).

The scheduler records what a save it asks for will cover (``expect``); the workers' reports name
the chunks by key digest; this log turns the two into events. It remembers at most
``MAX_TRACKED`` chunks (older ones leave no further events).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtier.core.keys import Scope

if TYPE_CHECKING:
    from vllm.v1.request import Request

MAX_TRACKED = 8192
OWNER = "kvtier"
# kvtier tier name -> the event's medium (other tiers: their name, upper-cased).
MEDIA = {"local_cpu": MEDIUM_CPU, "local_disk": "DISK"}


def medium_of(tier: str) -> str:
    return MEDIA.get(tier, tier.upper())


@dataclass
class _Chunk:
    """What a chunk's events say, and the media it is announced in."""

    block_hashes: list[Any]
    parent: Any
    token_ids: np.ndarray
    lora_id: int | None
    lora_name: str | None
    media: set[str] = field(default_factory=set)


class EventLog:
    """Pending and published chunk events of the scheduler side (see the module docstring)."""

    def __init__(
        self,
        block_size: int,
        enabled: bool,
        digest: Callable[[bytes, Scope], str | None],
        groups: Sequence[tuple[str, int | None]] = (),
        stateful: Sequence[int] = (),
        group_block_sizes: Sequence[int] = (),
        hash_block_size: int | None = None,
    ) -> None:
        """``digest(chunk_hash, scope)``: rank 0's key digest of a chunk (None until rank 0
        has reported its key namespace); ``groups``: a hybrid model's (spec kind, window) per
        KV cache group (``CacheGroups.event_specs``), empty for one group; ``stateful``: its
        Mamba groups, whose blocks a chunk does not hold (no event names them);
        ``group_block_sizes``: each group's block size where they differ;
        ``hash_block_size``: the tokens of one of the request's block hashes (default
        ``block_size``)."""
        self.block_size = block_size
        self.hash_block = hash_block_size or block_size
        self.enabled = enabled
        # The group fields of each chunk's events (one event per group, or one without
        # them), each with its group's block size.
        self._group_fields: list[tuple[dict[str, Any], int]] = [
            (
                {"group_idx": i, "kv_cache_spec_kind": kind, "kv_cache_spec_sliding_window": w},
                group_block_sizes[i] if group_block_sizes else block_size,
            )
            for i, (kind, w) in enumerate(groups)
            if i not in stateful
        ] or [({}, block_size)]
        self._digest = digest
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()  # rank-0 key digest -> chunk
        self._unnamed: list[tuple[bytes, Scope, _Chunk]] = []  # expected before rank 0 reported
        self._events: list[KVCacheEvent] = []

    def expect(
        self, request: Request, spans: Sequence[tuple[bytes, int, int]], scope: Scope
    ) -> None:
        """A save of ``request`` was asked for: ``(chunk hash, start, end)`` per chunk."""
        if not self.enabled:
            return
        bs = self.hash_block
        hashes = request.block_hashes
        lora = request.lora_request
        tokens = request.all_token_ids
        for chunk_hash, start, end in spans:
            if end // bs > len(hashes):
                continue
            chunk = _Chunk(
                [maybe_convert_block_hash(h) for h in hashes[start // bs : end // bs]],
                maybe_convert_block_hash(hashes[start // bs - 1]) if start else None,
                np.asarray(tokens[start:end], dtype=np.int64),
                lora.adapter_id if lora else None,
                lora.name if lora else None,
            )
            self._unnamed.append((chunk_hash, scope, chunk))
        self._name()

    def _name(self) -> None:
        """File expected chunks under rank 0's key digest, once it can be computed."""
        keep = []
        for chunk_hash, scope, chunk in self._unnamed:
            digest = self._digest(chunk_hash, scope)
            if digest is None:
                keep.append((chunk_hash, scope, chunk))
            elif digest not in self._chunks:
                self._chunks[digest] = chunk
        self._unnamed = keep[-MAX_TRACKED:]
        while len(self._chunks) > MAX_TRACKED:
            self._chunks.popitem(last=False)

    def stored(self, tier: str, digests: Iterable[str]) -> None:
        """Rank 0 reports these chunks written to ``tier``."""
        medium = medium_of(tier)
        if self._unnamed:
            self._name()
        for d in digests:
            c = self._chunks.get(d)
            if c is None or medium in c.media:
                continue
            c.media.add(medium)
            for group, bs in self._group_fields:
                self._events.append(
                    BlockStored(
                        block_hashes=self._hashes(c, bs),
                        parent_block_hash=c.parent,
                        token_ids=c.token_ids.tolist(),
                        block_size=bs,
                        lora_id=c.lora_id,
                        medium=medium,
                        lora_name=c.lora_name,
                        ownership=OWNER,
                        **group,
                    )
                )

    def removed(self, tier: str, digests: Iterable[str]) -> None:
        """Rank 0 reports these chunks gone from ``tier``."""
        medium = medium_of(tier)
        for d in digests:
            c = self._chunks.get(d)
            if c is None or medium not in c.media:
                continue
            c.media.discard(medium)
            for group, bs in self._group_fields:
                self._events.append(
                    BlockRemoved(
                        block_hashes=self._hashes(c, bs),
                        medium=medium,
                        ownership=OWNER,
                        group_idx=group.get("group_idx"),
                    )
                )
            if not c.media:
                del self._chunks[d]

    def _hashes(self, chunk: _Chunk, block_size: int) -> list[Any]:
        """The chunk's block hashes for blocks of ``block_size`` tokens: the hash at each
        block's last hash boundary (vLLM's ``BlockHashListWithBlockSize``)."""
        scale = block_size // self.hash_block
        return chunk.block_hashes[scale - 1 :: scale] if scale > 1 else chunk.block_hashes

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

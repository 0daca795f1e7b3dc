"""CacheEngine: the engine-facing API (lookup, store, retrieve) over a StorageManager.

Chunking: a prompt is cut into full chunks of ``chunk_size`` tokens; with ``save_unfull_chunk``
the tail after the last full chunk is also stored, one block per span, each chained onto the
previous key. A lookup takes the contiguous run of full-chunk hits and then, at the first
full-chunk miss, the contiguous run of stored tail blocks there. A repeated prompt therefore
recomputes less than a block, and a prompt that shares only part of a stored tail (same
document, another question) still hits every whole block it shares, without shrinking the chunk
size for everything.

Holds: ``hold(tokens)`` looks a prompt up *and* keeps its hit objects in host memory (fetching
lower-tier hits now, like a prefetch) until the hold is released, so a load that follows the
lookup cannot come up short because a chunk was evicted in between.

Scopes: every method that takes ``salt`` accepts a bare cache salt or a ``KeyScope`` (salt,
adapter identity, weights generation); see ``kvtier.core.keys``.

Slot mappings: ``slot_mapping[i]`` is token ``i``'s slot in the paged cache, ``-1`` when the
engine does not hold it (store: the chunk cannot be saved) or does not want it (retrieve: the
engine already has it, or it is past what the engine asked for).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.connector import DeviceConnector, Transfer
from kvtier.core.errors import ConfigError, KVTierError
from kvtier.core.handles import ChunkSpan, EngineStats, Hold, RetrieveJob, prefix_digest
from kvtier.core.keys import (
    ChunkKey,
    KeyFactory,
    Scope,
    TokenIds,
    chain_hash,
    salt_seed,
    tail_hashes,
    token_bytes,
)
from kvtier.core.layout import KVLayout
from kvtier.core.memory import MemoryObj, MemoryObjMeta
from kvtier.core.platform import Marker, Platform, get_platform
from kvtier.core.storage import StorageManager, create_storage_manager

logger = logging.getLogger("kvtier")

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
        if config.chunk_size % layout.block_size:
            raise ConfigError(
                "chunk_size",
                config.chunk_size,
                f"must be a multiple of the engine's block size {layout.block_size}",
            )
        self.config = config
        self.layout = layout
        self.chunk_size = config.chunk_size
        self.keys = KeyFactory(model, layout.fingerprint(), world_size, rank)
        self.platform = platform or get_platform(config.platform, config.plugins)
        if storage is None:
            arena = self.platform.create_arena(
                int(config.local_cpu_size_gb * GiB), pin_memory=config.pin_memory
            )
            namespace = self.keys.key(b"").namespace()
            storage = create_storage_manager(config, arena, layout, namespace)
        self.storage = storage
        self.connector: DeviceConnector | None = None
        self.stats = EngineStats()
        self._hit_tokens_by_tier: dict[str, int] = {}
        self._tier_lock = threading.Lock()
        self._store_listeners: list[Callable[[list[ChunkKey]], None]] = []

    # -- setup ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Hand over the engine's per-layer paged KV tensors (once, before any transfer)."""
        self.connector = self.platform.create_connector(
            kv_caches, self.layout, staging_buffer=self.config.device_staging_buffer
        )

    def watch_stores(self, listener: Callable[[list[ChunkKey]], None]) -> None:
        """Call ``listener(keys)`` with the keys of the chunks every store commits, on the
        storing thread, after they are readable (the vLLM connector feeds its scheduler's index
        of stored chunks with it). It must be quick and must not raise."""
        self._store_listeners.append(listener)

    def _require_connector(self) -> DeviceConnector:
        if self.connector is None:
            raise KVTierError("register_kv_caches must be called before store/retrieve")
        return self.connector

    # -- chunking ------------------------------------------------------------------------------
    def full_spans(self, tokens: TokenIds, salt: Scope = None) -> list[ChunkSpan]:
        arr = token_bytes(tokens)
        c = self.chunk_size
        prev = salt_seed(salt)
        spans = []
        for start in range(0, len(arr) - c + 1, c):
            prev = chain_hash(prev, arr[start : start + c])
            spans.append(ChunkSpan(start, start + c, self.keys.key(prev, salt)))
        return spans

    def _prev_hash(self, spans: Sequence[ChunkSpan], index: int, salt: Scope) -> bytes:
        return bytes.fromhex(spans[index - 1].key.chunk_hash) if index else salt_seed(salt)

    def tail_spans(
        self,
        tokens: TokenIds,
        index: int,
        salt: Scope = None,
        spans: Sequence[ChunkSpan] | None = None,
    ) -> list[ChunkSpan]:
        """Block-sized spans after full chunk ``index - 1``: whole blocks of ``tokens`` up to one
        block short of a chunk, each keyed by chaining its block onto the previous key.

        Keying the tail block by block lets a prompt that shares only part of a stored tail
        (same document, different question) hit every block it shares. A tail key can never
        equal a full-chunk key: their hash inputs differ in length.
        """
        arr = token_bytes(tokens)
        if spans is None:
            spans = self.full_spans(arr[: index * self.chunk_size], salt)
        bs = self.layout.block_size
        start = index * self.chunk_size
        hashes = tail_hashes(arr, start, self.chunk_size, bs, self._prev_hash(spans, index, salt))
        return [
            ChunkSpan(start + i * bs, start + (i + 1) * bs, self.keys.key(h, salt))
            for i, h in enumerate(hashes)
        ]

    def hit_spans(self, tokens: TokenIds, salt: Scope = None) -> list[ChunkSpan]:
        """The contiguous run of stored spans covering a prefix of ``tokens``."""
        arr = token_bytes(tokens)
        spans = self.full_spans(arr, salt)
        n_hit = self.storage.prefix_hits([s.key for s in spans])
        hits = spans[:n_hit]
        if self.config.save_unfull_chunk:
            tail = self.tail_spans(arr, n_hit, salt, spans)
            if tail:
                hits.extend(tail[: self.storage.prefix_hits([s.key for s in tail])])
        return hits

    def store_spans(self, tokens: TokenIds, salt: Scope = None) -> list[ChunkSpan]:
        """Spans ``store`` would save for ``tokens``: full chunks, then the tail block by block."""
        arr = token_bytes(tokens)
        spans = self.full_spans(arr, salt)
        if self.config.save_unfull_chunk:
            spans.extend(self.tail_spans(arr, len(spans), salt, spans))
        return spans

    # -- API -----------------------------------------------------------------------------------
    def lookup(self, tokens: TokenIds, salt: Scope = None) -> int:
        """Number of leading tokens of ``tokens`` whose KV is stored (a multiple of the block size)."""
        hits = self.hit_spans(tokens, salt)
        n = hits[-1].end if hits else 0
        self.stats.add(lookups=1, lookup_hit_tokens=n)
        return n

    def _fetch_prefix(self, spans: Sequence[ChunkSpan]) -> tuple[list[ChunkSpan], list[MemoryObj]]:
        """Get the objects of ``spans``; keep only the contiguous run from the first one.

        Once a chunk is gone (or is not what its span says), later chunks are useless: they are
        released, not returned.
        """
        objs = self.storage.batched_get([s.key for s in spans]) if spans else []
        kept: list[MemoryObj] = []
        for i, (span, obj) in enumerate(zip(spans, objs, strict=True)):
            if obj is None:
                continue
            if len(kept) == i and obj.num_tokens == span.num_tokens:
                kept.append(obj)
            else:
                obj.release()
        if len(kept) < len(spans):
            self.stats.add(retrieve_misses=1)
        return list(spans[: len(kept)]), kept

    def hold(self, tokens: TokenIds, salt: Scope = None) -> Hold:
        """Look ``tokens`` up and keep the hit prefix's objects in host memory (see ``Hold``)."""
        arr = token_bytes(tokens)
        hits = self.hit_spans(arr, salt)
        sources = self.chunk_sources([s.key for s in hits])
        spans, objs = self._fetch_prefix(hits)
        hold = Hold(
            spans,
            objs,
            prefix_digest(arr[: spans[-1].end if spans else 0], salt),
            sources=sources[: len(spans)],
        )
        self.stats.add(lookups=1, lookup_hit_tokens=hold.num_tokens)
        self._count_tier_hits(spans, hold.sources)
        return hold

    def chunk_sources(self, keys: Sequence[ChunkKey]) -> list[str]:
        """The tier name holding each of ``keys`` (all stored), host memory first; for metrics
        and vLLM's hit sources. The host tier's index is asked first; lower tiers but the last
        only with more than one lower tier (disk: a stat per chunk not in host memory); a key
        none of them holds is labelled with the last tier. A chunk that moves between tiers
        meanwhile may be labelled either way (metrics only; what is loaded is the held data)."""
        host = getattr(self.storage, "host", None)
        lower = list(getattr(self.storage, "lower", ()))
        if host is None:
            return ["local_cpu"] * len(keys)
        out = [str(host.name) if h else "" for h in host.contains(keys)] if keys else []
        rest = [i for i, name in enumerate(out) if not name]
        for tier in lower[:-1]:
            if not rest:
                break
            found = tier.contains([keys[i] for i in rest])
            for i, f in zip(rest, found, strict=True):
                if f:
                    out[i] = str(tier.name)
            rest = [i for i in rest if not out[i]]
        last = str(lower[-1].name) if lower else "unknown"
        for i in rest:
            out[i] = last
        return out

    def _count_tier_hits(self, spans: Sequence[ChunkSpan], sources: Sequence[str]) -> None:
        with self._tier_lock:
            for span, tier in zip(spans, sources, strict=True):
                self._hit_tokens_by_tier[tier] = (
                    self._hit_tokens_by_tier.get(tier, 0) + span.num_tokens
                )

    def hit_tokens_by_tier(self) -> dict[str, int]:
        """Tokens found by ``hold`` so far, by the tier that held each chunk."""
        with self._tier_lock:
            return dict(self._hit_tokens_by_tier)

    def _slots(self, slot_mapping: torch.Tensor | Sequence[int], n_tokens: int) -> torch.Tensor:
        """``slot_mapping`` as a long tensor, checked: integers, one per token, each -1 or a slot
        of the registered cache (``ValueError`` naming the bad entry otherwise)."""
        if isinstance(slot_mapping, torch.Tensor):
            bad_dtype = (
                slot_mapping.is_floating_point()
                or slot_mapping.is_complex()
                or slot_mapping.dtype == torch.bool
            )
            dtype_name = str(slot_mapping.dtype)
        else:
            kind = np.asarray(slot_mapping).dtype
            bad_dtype, dtype_name = len(slot_mapping) > 0 and kind.kind not in "iu", str(kind)
        if bad_dtype:
            raise ValueError(f"slot_mapping must hold integers, got {dtype_name}")
        slots = torch.as_tensor(slot_mapping, dtype=torch.long)
        if slots.dim() != 1 or slots.numel() != n_tokens:
            raise ValueError(
                f"slot_mapping must have one entry per token ({n_tokens}), got shape {tuple(slots.shape)}"
            )
        if slots.numel():
            lo, hi = (int(v) for v in torch.aminmax(slots))
            num_slots = (
                self.connector.num_blocks * self.layout.block_size
                if self.connector is not None
                else None
            )
            if lo < -1:
                raise ValueError(f"slot_mapping entry {lo} is invalid: a slot is -1 (none) or >= 0")
            if num_slots is not None and hi >= num_slots:
                raise ValueError(
                    f"slot_mapping entry {hi} is out of range: the registered KV cache "
                    f"has {num_slots} slots"
                )
        return slots

    def _meta(self, num_tokens: int) -> MemoryObjMeta:
        return MemoryObjMeta(
            self.layout.chunk_shape(num_tokens), self.layout.torch_dtype, num_tokens
        )

    def _plan_store(
        self, tokens: TokenIds, slot_mapping: torch.Tensor | Sequence[int], salt: Scope
    ) -> list[tuple[ChunkSpan, Transfer]]:
        arr = token_bytes(tokens)
        slots = self._slots(slot_mapping, len(arr))
        cpu_slots = slots.cpu()
        spans = [
            s for s in self.store_spans(arr, salt) if bool((cpu_slots[s.start : s.end] >= 0).all())
        ]
        if not spans:
            return []
        present = self.storage.contains([s.key for s in spans])
        plan: list[tuple[ChunkSpan, Transfer]] = []
        for span, have in zip(spans, present, strict=True):
            if have:
                continue
            obj = self.storage.allocate(self._meta(span.num_tokens))
            if obj is None:
                logger.warning(
                    "kvtier host memory is full: %d chunk(s) not stored", len(spans) - len(plan)
                )
                self.stats.add(store_skipped_chunks=len(spans) - len(plan))
                break
            plan.append((span, Transfer(obj, slots[span.start : span.end])))
        return plan

    def _commit_store(self, plan: Sequence[tuple[ChunkSpan, Transfer]]) -> int:
        stored = 0
        for span, t in plan:
            with t.obj:
                self.storage.put(span.key, t.obj)
            stored += span.num_tokens
        self.stats.add(stored_tokens=stored)
        keys = [span.key for span, _ in plan]
        for listener in self._store_listeners:
            listener(keys)
        return stored

    def _abort(self, objs: Sequence[MemoryObj]) -> None:
        for obj in objs:
            if not obj.released:
                obj.release()

    def store(
        self,
        tokens: TokenIds,
        slot_mapping: torch.Tensor | Sequence[int],
        *,
        salt: Scope = None,
        ready: Marker = None,
        keep: Callable[[], bool] | None = None,
    ) -> int:
        """Save every storable span of ``tokens`` not already stored; returns tokens newly stored.

        A span is storable when all its slots are valid (>= 0). Skipped silently when host
        memory is exhausted (counted in ``stats.store_skipped_chunks``).

        ``ready``: a marker from ``platform.record_marker()`` taken on the thread whose device
        work wrote this KV (vLLM's forward pass); the copy is ordered after it. Needed whenever
        ``store`` runs on another thread than the one that computed the KV: device work is
        ordered per stream, and another thread's current stream does not wait for the compute
        stream. ``keep``: asked once the copy is done; if it returns False the copied chunks
        are dropped, nothing is stored (the engine's blocks may have been reused meanwhile).
        """
        connector = self._require_connector()
        plan = self._plan_store(tokens, slot_mapping, salt)
        if not plan:
            return 0
        try:
            self.platform.wait_marker(ready)
            connector.store([t for _, t in plan])
        except BaseException:
            self._abort([t.obj for _, t in plan])
            raise
        if keep is not None and not keep():
            self._abort([t.obj for _, t in plan])
            self.stats.add(store_abandoned_chunks=len(plan))
            return 0
        return self._commit_store(plan)

    def store_layerwise(
        self, tokens: TokenIds, slot_mapping: torch.Tensor | Sequence[int], *, salt: Scope = None
    ) -> Iterator[int]:
        """Like ``store``, one layer per ``next()``; the chunks are saved when it is exhausted."""
        connector = self._require_connector()
        plan = self._plan_store(tokens, slot_mapping, salt)
        try:
            if plan:
                yield from connector.store_layerwise([t for _, t in plan])
            else:
                yield from range(self.layout.num_layers)
        except BaseException:
            self._abort([t.obj for _, t in plan])
            raise
        self._commit_store(plan)

    def _plan_retrieve(
        self,
        tokens: TokenIds,
        slot_mapping: torch.Tensor | Sequence[int],
        salt: Scope,
        hold: Hold | None,
    ) -> tuple[list[Transfer], torch.Tensor]:
        arr = token_bytes(tokens)
        slots = self._slots(slot_mapping, len(arr))
        cpu_slots = slots.cpu()
        mask = torch.zeros(len(arr), dtype=torch.bool)

        def wanted(span: ChunkSpan) -> bool:
            return bool((cpu_slots[span.start : span.end] >= 0).any())

        if hold is None:
            spans, objs = self._fetch_prefix([s for s in self.hit_spans(arr, salt) if wanted(s)])
        else:
            if hold.released:
                raise KVTierError("retrieve got a hold that was already released")
            if hold.num_tokens > len(arr) or hold.digest != prefix_digest(
                arr[: hold.num_tokens], salt
            ):
                raise ValueError("retrieve got a hold taken for other tokens or another salt")
            pairs = [
                (s, o.share()) for s, o in zip(hold.spans, hold.objs, strict=True) if wanted(s)
            ]
            spans, objs = [s for s, _ in pairs], [o for _, o in pairs]
        transfers = []
        for span, obj in zip(spans, objs, strict=True):
            transfers.append(Transfer(obj, slots[span.start : span.end]))
            mask[span.start : span.end] = cpu_slots[span.start : span.end] >= 0
        return transfers, mask

    def retrieve(
        self,
        tokens: TokenIds,
        slot_mapping: torch.Tensor | Sequence[int],
        *,
        salt: Scope = None,
        hold: Hold | None = None,
        ready: Marker = None,
    ) -> torch.Tensor:
        """Load the stored prefix of ``tokens`` into the slots that are not -1.

        With ``hold`` (from ``hold(tokens, salt)``), load exactly the held objects (the hold stays
        the caller's to release). Returns a bool mask (one per token) of the tokens whose KV was
        written into the cache. ``ready``: as for ``store`` (a load issued on another thread
        must not overwrite blocks that earlier device work on the compute stream still reads).
        """
        connector = self._require_connector()
        transfers, mask = self._plan_retrieve(tokens, slot_mapping, salt, hold)
        try:
            if transfers:
                self.platform.wait_marker(ready)
                connector.load(transfers)
        finally:
            self._abort([t.obj for t in transfers])
        self.stats.add(retrieved_tokens=int(mask.sum()))
        return mask

    def retrieve_layerwise(
        self,
        tokens: TokenIds,
        slot_mapping: torch.Tensor | Sequence[int],
        *,
        salt: Scope = None,
        hold: Hold | None = None,
    ) -> RetrieveJob:
        """Fetch the stored prefix now; load it layer by layer as the job's ``layers`` is iterated."""
        connector = self._require_connector()
        transfers, mask = self._plan_retrieve(tokens, slot_mapping, salt, hold)

        def layers() -> Iterator[int]:
            try:
                if transfers:
                    yield from connector.load_layerwise(transfers)
                else:
                    yield from range(self.layout.num_layers)
            finally:
                self._abort([t.obj for t in transfers])
            self.stats.add(retrieved_tokens=int(mask.sum()))

        return RetrieveJob(mask, layers())

    def close(self) -> None:
        self.storage.close()

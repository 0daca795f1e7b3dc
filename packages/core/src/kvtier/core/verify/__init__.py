"""Verification by recompute: KV the engine has just computed for a prefix, compared page by
page with the stored chunks a lookup found for that prefix.

Checksums catch a payload damaged after it was written; they cannot catch KV that was wrong
when it was written or read into the wrong place (a layout read the wrong way, another host's
interior, a key missing part of a request's identity, a race). The vLLM connector samples
requests that have a hit (``verify_fraction``), lets vLLM compute their prefix itself and then
calls ``Verifier.check`` with the held chunks and the slots vLLM wrote.

The comparison: each page (one layer's one block) is read as the cache's element type, and its
error is ``mean |stored - fresh| / mean |fresh|``. KV recomputed by the same engine in another
batch shape differs from the stored KV by rounding only (docs/verification.md); another
prompt's KV, another layer's, or pages packed for another ISA differ by the size of the values
themselves (an error of 1 or more). A chunk whose worst page
is over the tolerance is removed from every tier, and the tier it came from is quarantined
(every read a miss) for ``verify_quarantine_s``.

Pages whose elements kvtier cannot read as numbers (a quantized cache with scales packed into
its pages) cannot be verified: ``verify_dtype`` is None, and the vLLM connector's scheduler,
reading the same from vLLM's cache spec, samples nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtier.core.engine.slots import checked_slots, span_rows
from kvtier.core.engine.store_writer import release_all
from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey, Scope, TokenIds
from kvtier.core.layout import KVLayout
from kvtier.core.memory import MemoryObj, MemoryObjMeta
from kvtier.core.memory.handles import ChunkSpan, Hold
from kvtier.core.platform.mover import PageMover, Transfer
from kvtier.core.verify.compare import page_errors, state_error, state_parts

if TYPE_CHECKING:
    from kvtier.core.engine import CacheEngine
    from kvtier.core.platform import Marker

logger = logging.getLogger("kvtier")

# The largest page error (mean |stored - fresh| / mean |fresh|) still taken for rounding, by the
# cache's element type: well below the error of wrong KV (1 or more) and well above a recompute's
# drift; how they were chosen, and from which measurements: docs/verification.md.
DEFAULT_TOLERANCE = {
    torch.float32: 0.01,
    torch.float16: 0.1,
    torch.bfloat16: 0.2,
    torch.float8_e4m3fn: 0.5,
    torch.float8_e5m2: 0.5,
}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def verify_dtype(layout: KVLayout) -> torch.dtype | None:
    """The element type a page of ``layout`` is read as, or None when its bytes are not plain
    elements (scales packed next to values)."""
    if layout.cache_dtype.startswith("fp8"):
        dtype = torch.float8_e5m2 if "e5m2" in layout.cache_dtype else torch.float8_e4m3fn
    elif layout.torch_dtype in _FLOATS:
        dtype = layout.torch_dtype
    else:
        return None
    dense = layout.head_size * (1 if layout.use_mla else 2) * dtype.itemsize
    return dtype if layout.content_bytes in (0, dense) else None


@dataclass(frozen=True)
class _Picked:
    """A held chunk to check: its span, object, source tier and the cache block of each of its
    blocks (-1: not computed by the engine itself, not compared)."""

    span: ChunkSpan
    held: MemoryObj
    tier: str
    blocks: torch.Tensor


@dataclass(frozen=True)
class ChunkCheck:
    """One stored chunk against the recomputed KV: its worst page's error (at ``layer`` and
    ``block``, the block's index in the chunk) and the tier the chunk was read from."""

    key: ChunkKey
    tier: str
    error: float
    layer: int
    block: int  # a state entry's: its state group
    tolerance: float
    state: bool = False  # a recurrent-state entry (``check_state``), not a chunk

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


class Verifier:
    """Checks held chunks against freshly computed KV for one engine; removes and quarantines
    what is wrong; counts what it checked (see the module docstring)."""

    def __init__(self, engine: CacheEngine, *, tolerance: float, quarantine_s: float) -> None:
        self.engine = engine
        self.dtype = verify_dtype(engine.layout)
        default = DEFAULT_TOLERANCE.get(self.dtype, 0.0) if self.dtype is not None else 0.0
        self.tolerance = tolerance or default
        self.quarantine_s = quarantine_s
        self._lock = threading.Lock()
        self.chunks = 0  # chunks found right
        self.states = 0  # state entries found right (``check_state``)
        self.mismatches: dict[str, int] = {}  # by tier
        self.worst_ok = 0.0  # the largest error of a chunk found right
        self.least_bad = float("inf")  # the smallest error of a chunk found wrong

    @property
    def available(self) -> bool:
        return self.dtype is not None

    def _mover(self) -> PageMover:
        mover = self.engine.mover
        if mover is None:
            raise KVTierError("register_kv_caches must be called before verification")
        return mover

    def check(
        self,
        tokens: Sized,
        slot_mapping: torch.Tensor | Sequence[int],
        hold: Hold,
        *,
        ready: Marker = None,
    ) -> list[ChunkCheck]:
        """Compare the chunks of ``hold`` with the KV at ``slot_mapping`` (computed for
        ``tokens``; ``-1`` for tokens the engine did not compute itself, which are not
        compared; ``ready`` orders the copy after the device work that wrote the KV), block by
        block. Wrong chunks are removed and their tiers quarantined. The hold stays the
        caller's."""
        if self.dtype is None:
            raise NotImplementedError(
                f"kvtier cannot read {self.engine.layout.describe()} pages as numbers: "
                "verification needs plain float or fp8 elements"
            )
        layout = self.engine.layout
        bs = layout.slot_block_sizes
        limit = [self._mover().num_blocks * b for b in bs]
        slots = checked_slots(slot_mapping, len(tokens), limit, layout.num_groups)
        tiers = hold.sources + ["unknown"] * (len(hold.spans) - len(hold.sources))
        picked: list[_Picked] = []
        for span, obj, tier in zip(hold.spans, hold.objs, tiers, strict=False):
            if span.end > len(tokens):
                break
            blocks = span_rows(slots, span.start, span.end, bs)
            if bool((blocks >= 0).any()):
                picked.append(_Picked(span, obj, tier, blocks))
        fresh = self._copies(picked, ready)
        try:
            checks = [self._compare(p, obj) for p, obj in zip(picked, fresh, strict=False)]
        finally:
            release_all(fresh)
        self._act(checks)
        return checks

    def check_state(
        self,
        tokens: TokenIds,
        scope: Scope,
        hold: Hold,
        blocks: Sequence[int],
        *,
        ready: Marker = None,
    ) -> ChunkCheck | None:
        """Compare the state entry ``hold`` was cut to (``hold.state``) with the state the
        engine recomputed at the same boundary, in ``blocks`` (one cache block per state group,
        as vLLM offered it); a wrong entry is removed and its tier quarantined. None when there
        is nothing to compare: no held state, a state kind that does not name its tensors, or
        no host memory for the copy."""
        engine = self.engine
        parts = [state_parts(kind) for kind in engine.layout.states]
        if hold.state is None or engine.states is None or None in parts:
            return None
        boundary, held = hold.state
        fresh = engine.storage.allocate(held.meta)
        if fresh is None:
            logger.warning("kvtier: host memory full, a state entry not verified")
            return None
        try:
            engine.platform.wait_marker(ready)
            self._mover().store([Transfer(fresh, torch.tensor(list(blocks), dtype=torch.long))])
            worst = state_error(fresh.tensor, held.tensor, [p for p in parts if p is not None])
        finally:
            fresh.release()
        key = engine.states.key(engine.spans.prompt(tokens, scope), boundary)
        tier = hold.state_source or "unknown"
        check = ChunkCheck(
            key, tier, worst.error, worst.layer, worst.group, self.tolerance, state=True
        )
        self._act([check])
        return check

    def _copies(self, picked: list[_Picked], ready: Marker) -> list[MemoryObj]:
        """The recomputed pages of each picked span, in new host objects (fewer when host
        memory runs out: the rest is not checked)."""
        layout = self.engine.layout
        transfers: list[Transfer] = []
        for p in picked:
            n = p.span.num_tokens
            obj = self.engine.storage.allocate(
                MemoryObjMeta(layout.chunk_shape(n), layout.chunk_dtype, n)
            )
            if obj is None:
                left = len(picked) - len(transfers)
                logger.warning("kvtier: host memory full, %d chunk(s) not verified", left)
                break
            transfers.append(Transfer(obj, p.blocks))
        objs = [t.obj for t in transfers]
        try:
            if transfers:
                self.engine.platform.wait_marker(ready)
                self._mover().store(transfers)
        except BaseException:
            release_all(objs)
            raise
        return objs

    def _compare(self, p: _Picked, fresh: MemoryObj) -> ChunkCheck:
        assert self.dtype is not None
        rows = torch.nonzero(p.blocks >= 0).flatten()
        stored = p.held.tensor[: len(p.blocks)]
        err = page_errors(fresh.tensor[rows], stored[rows], self.dtype)
        worst = int(torch.argmax(err))
        row, layer = divmod(worst, err.shape[1])
        block = int(rows[row]) // self.engine.layout.rows_per_block  # a block's rows in turn
        return ChunkCheck(
            p.span.key, p.tier, float(err.flatten()[worst]), layer, block, self.tolerance
        )

    def _act(self, checks: list[ChunkCheck]) -> None:
        bad = [c for c in checks if not c.ok]
        with self._lock:
            good = [c for c in checks if c.ok]
            self.states += sum(c.state for c in good)
            self.chunks += sum(not c.state for c in good)
            self.worst_ok = max([self.worst_ok, *(c.error for c in good)])
            for c in bad:
                self.mismatches[c.tier] = self.mismatches.get(c.tier, 0) + 1
                self.least_bad = min(self.least_bad, c.error)
        if not bad:
            return
        storage = self.engine.storage
        storage.remove([c.key for c in bad])
        for tier in sorted({c.tier for c in bad}):
            storage.quarantine(tier, self.quarantine_s)
        for c in bad:
            logger.error(
                "kvtier: verification: %s %s from tier %s is not the %s vLLM recomputed "
                "(layer %d, %s %d: error %.3g, tolerance %.3g); removed from every tier, %s "
                "quarantined for %.0f s",
                "state entry" if c.state else "chunk",
                c.key.to_string(),
                c.tier,
                "state" if c.state else "KV",
                c.layer,
                "state group" if c.state else "block of the chunk",
                c.block,
                c.error,
                c.tolerance,
                c.tier,
                self.quarantine_s,
            )

    def values(self) -> dict[str, dict[str, float]]:
        """``verify_chunks`` and ``verify_mismatches`` (by tier), as metric values."""
        with self._lock:
            return {"verify_chunks": {"": self.chunks}, "verify_mismatches": dict(self.mismatches)}

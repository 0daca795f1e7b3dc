"""Everything that crosses between the scheduler process and the worker processes.

The scheduler side sends ``KVTierMetadata`` with each step (pickled into vLLM's connector
metadata: loads, saves, probes, releases, lazy saves); the workers answer with a
``KVTierWorkerMeta`` in each step's output (what they stored, probe answers, lazy saves
copied). Token arrays here are *identity tokens* (``identity.identity_tokens``): the request's
token ids with multimodal placeholders replaced by ids derived from each item's content hash;
they are only hashed into chunk keys, the KV itself comes from the paged cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import KeyScope
from kvtier.vllm_integration.groups import null_to_slot

HOLD_TTL_MIN_S = 30.0


def hold_ttl_s(config: KVTierConfig) -> float:
    """How long the worker keeps a probe's hold with no load: 10x ``lookup_timeout_s``, at
    least 30 s. A load normally follows its probe within a step or two, and a request waiting
    longer than half of this is probed again, so only a lost hold (a decision the worker never
    heard of) lives this long."""
    return max(HOLD_TTL_MIN_S, 10.0 * config.lookup_timeout_s)


@dataclass
class ProbeSpec:
    """Look ``tokens`` (a prompt's identity tokens) up under ``scope`` and hold the hit as hold
    ``hold_id`` of ``req_id``."""

    req_id: str
    hold_id: int
    tokens: np.ndarray
    scope: KeyScope
    # A consumer's request: the receipt its producer announced (``kvtier.core.keys.receipts``),
    # asked for before the chunks.
    receipt: bytes | None = None


@dataclass
class LoadSpec:
    """Load tokens ``[start, end)`` of ``tokens`` (the whole prompt) into ``block_ids``."""

    req_id: str
    tokens: np.ndarray
    block_ids: list[int]
    start: int
    end: int
    scope: KeyScope
    hold_id: int | None = None  # the worker's hold from this request's lookup
    # Load on the worker's loader thread and report it in get_finished (the request waits in
    # WAITING_FOR_REMOTE_KVS); else before this step's forward pass.
    load_async: bool = False
    # The live block ids of every KV cache group a chunk holds pages of, for a model with
    # window or Mamba layers (``groups.py``; ``block_ids`` is then the primary group's); None
    # for a model without them.
    groups: list[list[int]] | None = None
    # A Mamba hybrid's: the block of each Mamba group that takes the state at ``end``.
    states: list[int] | None = None


@dataclass
class SaveSpec:
    """Save the chunks of ``tokens`` that start at or after ``skip`` (they live in
    ``block_ids``)."""

    req_id: str
    tokens: np.ndarray
    block_ids: list[int]
    skip: int
    scope: KeyScope
    groups: list[list[int]] | None = None  # as LoadSpec's
    # A Mamba hybrid's states to store: ``(boundary, block of each Mamba group)``, from vLLM's
    # boundary-state offers of this step (``scheduler/hybrid.py``).
    states: list[tuple[int, list[int]]] = field(default_factory=list)


@dataclass
class ReceiptSpec:
    """A producer's request ``req_id`` has had its last save: write its hand-over receipt
    (``kvtier.core.keys.receipts``), after those saves."""

    req_id: str
    receipt: bytes
    scope: KeyScope


@dataclass
class VerifySpec:
    """Compare the stored chunks of ``tokens`` (a prompt prefix this step's forward pass has
    computed, in ``block_ids``) with that KV (``kvtier.core.verify``). ``hold_id``: the worker's
    hold from the request's lookup; None (or a hold gone since) looks the prefix up again."""

    req_id: str
    tokens: np.ndarray
    block_ids: list[int]
    scope: KeyScope
    hold_id: int | None = None
    start: int = 0  # tokens before it (whole blocks) were not computed by this request
    groups: list[list[int]] | None = None  # as LoadSpec's
    # A Mamba hybrid's recomputed state at the end of ``tokens``, where vLLM offered it this
    # step: ``(boundary, block of each Mamba group)``, compared with the held state entry.
    states: list[tuple[int, list[int]]] = field(default_factory=list)


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    releases: list[tuple[str, int]] = field(default_factory=list)  # holds not to be loaded
    probes: list[ProbeSpec] = field(default_factory=list)  # lookups to run on the workers
    # Saves of finished requests' blocks near eviction (``scheduler/lazy.py``); their ``req_id``
    # names the save, and the worker reports each one's copy done in ``LazyWorkerMeta``.
    lazy_saves: list[SaveSpec] = field(default_factory=list)
    # The weights generation every spec of this step is keyed under (``reset_cache`` may start
    # a new one); a worker that sees it change drops its host-memory tier.
    generation: str | None = None
    # Bumped by every ``reset_cache``: a worker that sees it change digests its live weights
    # and reports them (``RankReport.weights``).
    weights_epoch: int = 0
    # This step's serial number: workers report the last step whose saves they have copied.
    step: int = 0
    # vLLM scheduled no tokens this step (its requests wait, some on kvtier): the workers give
    # their threads the interpreter for a moment instead of returning to a spinning engine loop.
    idle: bool = False
    # Finished requests whose blocks vLLM freed at once, their saves copied already
    # (``scheduler/frees.py``): the workers do not report them in ``finished_sending``.
    unheld: list[str] = field(default_factory=list)
    # Sampled requests whose recomputed prefix is compared with what kvtier stores; run on the
    # saver before this step's saves, and like saves they keep the request's blocks until done.
    verifies: list[VerifySpec] = field(default_factory=list)
    # A hybrid model's window blocks that a save may still be reading were freed by vLLM and
    # are reused in this step: the workers finish their saves before anything writes.
    drain_saves: bool = False
    # A producer's hand-over receipts, written on the saver after this step's saves.
    receipts: list[ReceiptSpec] = field(default_factory=list)


def slot_mapping(
    block_ids: list[int], block_size: int, length: int, start: int, end: int
) -> np.ndarray:
    """Slots of tokens ``[start, end)`` (from the request's block table), ``-1`` elsewhere."""
    slots = np.full(length, -1, dtype=np.int64)
    if end > start:
        pos = np.arange(start, end, dtype=np.int64)
        blocks = np.asarray(block_ids, dtype=np.int64)
        if len(blocks) * block_size < end:
            raise ValueError(f"{len(blocks)} blocks of {block_size} cannot hold tokens up to {end}")
        slots[start:end] = blocks[pos // block_size] * block_size + pos % block_size
    return slots


def spec_slots(
    block_ids: list[int],
    groups: list[list[int]] | None,
    block_sizes: Sequence[int],
    length: int,
    start: int,
    end: int,
) -> np.ndarray:
    """``slot_mapping`` of a spec: ``[length]`` for one group, ``[groups, length]`` for a
    hybrid model's, each group's slots of its own block size (``block_sizes``, one per group
    of ``groups``, else the one of ``block_ids``); with ``groups`` (the live block ids of a
    model with window layers) vLLM's null block (a freed window block) has no slot."""
    if groups is None:
        return slot_mapping(block_ids, block_sizes[0], length, start, end)
    if len(block_sizes) != len(groups):
        raise ValueError(f"{len(groups)} groups of block ids need one block size each")
    rows = [
        null_to_slot(slot_mapping(ids, bs, length, start, end), ids, bs)
        for ids, bs in zip(groups, block_sizes, strict=True)
    ]
    return rows[0] if len(rows) == 1 else np.stack(rows)


@dataclass
class ProbeAnswer:
    """A worker's answer to one probe: the tokens it holds for the request (``hit``) and where
    each held chunk was found (``[[start, end, tier], ...]``)."""

    req_id: str
    hold_id: int
    hit: int
    sources: list[list[Any]] = field(default_factory=list)
    settled: bool = False  # the probe's receipt was found before the chunks were looked up


@dataclass
class RankReport:
    """What one worker tells the scheduler after a step."""

    rank: int
    namespace: tuple[str, str, int, int]  # KeyFactory(model, layout_fp, world_size, rank)
    complete: bool  # every tier lists its chunks: nothing is stored that the index cannot know
    capacity: int  # how many chunk keys the scheduler keeps for this rank at most
    added: list[str] = field(default_factory=list)  # ChunkKey.digest() of chunks now stored
    answers: list[ProbeAnswer] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)  # digests gone from host memory
    host_only: bool = False  # host memory is the only tier: what it drops is gone
    # (tier, digests written, digests dropped) of lower tiers, for KV events only
    tier_events: list[tuple[str, list[str], list[str]]] = field(default_factory=list)
    # (request id, tokens found): loads answered by the index that found only a prefix
    short: list[tuple[str, int]] = field(default_factory=list)
    lower_tier: str = ""  # the tier below host memory the index lists ("": none)
    listed: int = 0  # how many of ``added`` were listed in lower tiers at start (the first ones)
    # the last step whose saves this rank has all copied (``scheduler/frees.py``)
    saves_copied: int = -1
    # tiers a verification quarantined, with the seconds it lasts (``kvtier.core.verify``)
    quarantined: list[tuple[str, float]] = field(default_factory=list)
    # After a ``reset_cache``: (its weights epoch, the digest of this rank's live parameters,
    # whether they differ from those the rank started with) (``scheduler/generation.py``)
    weights: tuple[int, str, bool] | None = None


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """One step's reports of every worker (vLLM aggregates the workers' objects)."""

    reports: dict[int, RankReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTierWorkerMeta):
            return self
        merged = dict(self.reports)
        for rank, rep in other.reports.items():
            mine = merged.get(rank)
            if mine is None:
                merged[rank] = rep
            else:
                merged[rank] = RankReport(
                    rank,
                    rep.namespace,
                    rep.complete,
                    rep.capacity,
                    mine.added + rep.added,
                    mine.answers + rep.answers,
                    mine.evicted + rep.evicted,
                    rep.host_only,
                    mine.tier_events + rep.tier_events,
                    mine.short + rep.short,
                    rep.lower_tier,
                    mine.listed + rep.listed,
                    max(mine.saves_copied, rep.saves_copied),
                    mine.quarantined + rep.quarantined,
                    rep.weights or mine.weights,
                )
        return KVTierWorkerMeta(merged)


class AliasHash(bytes):
    """A tail hash standing for its alias entry (``KeyFactory.alias_key``) rather than for a
    tail-block entry: ``PresenceIndex`` digests it as the alias's key, so expectations and
    forgetting (``expect``, ``forget``) take chunk, tail and alias hashes in one list."""


@dataclass
class LazyWorkerMeta(KVTierWorkerMeta):
    """A step's reports plus, per worker rank, the lazy saves whose copies are done."""

    saved: dict[int, list[str]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        base = super().aggregate(other)
        reports = base.reports if isinstance(base, KVTierWorkerMeta) else self.reports
        saved = {rank: list(ids) for rank, ids in self.saved.items()}
        for rank, ids in getattr(other, "saved", {}).items():
            saved.setdefault(rank, []).extend(ids)
        return LazyWorkerMeta(reports, saved)

"""What the scheduler side tells the workers each step (pickled into vLLM's connector metadata).

Token arrays here are *identity tokens* (``identity.identity_tokens``): the request's token ids
with multimodal placeholders replaced by ids derived from each item's content hash. They are
only hashed into chunk keys; the KV itself comes from the paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvtier.core.keys import KeyScope
from kvtier.vllm_integration.probes import ProbeSpec


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


@dataclass
class SaveSpec:
    """Save the chunks of ``tokens`` that start at or after ``skip`` (they live in ``block_ids``)."""

    req_id: str
    tokens: np.ndarray
    block_ids: list[int]
    skip: int
    scope: KeyScope


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    releases: list[tuple[str, int]] = field(default_factory=list)  # holds not to be loaded
    probes: list[ProbeSpec] = field(default_factory=list)  # lookups to run on the workers
    # Saves of finished requests' blocks near eviction (``lazy.py``); their ``req_id`` names
    # the save, and the worker reports each one's copy done in ``LazyWorkerMeta``.
    lazy_saves: list[SaveSpec] = field(default_factory=list)
    # The weights generation every spec of this step is keyed under (``reset_cache`` starts a
    # new one); a worker that sees it change drops its host-memory tier.
    generation: str | None = None
    # This step's serial number: workers report the last step whose saves they have copied.
    step: int = 0
    # Finished requests whose blocks vLLM freed at once, their saves copied already
    # (``frees.py``): the workers do not report them in ``finished_sending``.
    unheld: list[str] = field(default_factory=list)


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

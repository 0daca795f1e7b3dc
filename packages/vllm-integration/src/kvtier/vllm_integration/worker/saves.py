"""The worker's saves: copies of computed chunks off the device, and the sampled checks.

Saves are asynchronous (``worker/save_thread.py``): ``submit`` (in ``wait_for_save``) hands the step's
saves to the saver thread with a device marker of the forward pass. The scheduler side keeps the
blocks of every request that had a save until the worker reports, through ``get_finished``
(``finished``), that the request's saves are done. Before vLLM reuses the blocks of a preempted
request (``handle_preemptions``) the saver is drained. With ``use_layerwise`` each layer is
captured in ``save_kv_layer`` right after attention wrote it, so the saves are complete when the
step ends. Lazy saves (``scheduler/lazy.py``: blocks of finished requests the scheduler touched)
go to the same saver; each one's copy is reported done (``lazy_copied``). Verifications
(``worker/verify.py``) run on the saver too, before the step's saves, and keep their blocks the
same way. A producer's hand-over receipts (``kvtier.core.keys.receipts``) run on it after the step's
saves: the receipt is put after every chunk of its request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Set
from typing import Any

import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.engine import CacheEngine
from kvtier.core.keys.receipts import write_receipt
from kvtier.core.platform import Marker
from kvtier.vllm_integration.messages import (
    KVTierMetadata,
    ReceiptSpec,
    SaveSpec,
    VerifySpec,
    spec_slots,
)
from kvtier.vllm_integration.stats import StatsTracker
from kvtier.vllm_integration.worker.save_thread import Saver
from kvtier.vllm_integration.worker.verify import WorkerVerify

logger = logging.getLogger("kvtier")

SAVE_DRAIN_TIMEOUT_S = 60.0


class WorkerSaves:
    """One worker's saves and checks (see the module docstring)."""

    def __init__(
        self,
        config: KVTierConfig,
        engine: CacheEngine,
        verify: WorkerVerify,
        *,
        layer_of: dict[str, int],
        count: Callable[..., None],
        metrics: StatsTracker,
    ) -> None:
        self.config = config
        self.engine = engine
        self.verify = verify
        self.layer_of = layer_of
        self._count = count
        self.metrics = metrics
        self.saver = Saver(self._run, self._done)
        self._store_gens: list[Iterator[int]] = []
        self._saving: set[str] = set()  # requests that had a save (their blocks are held)
        self._lazy: set[str] = set()  # lazy saves submitted, not yet reported copied
        self._finishing: set[str] = set()

    def _slots(self, spec: SaveSpec) -> torch.Tensor:
        n = len(spec.tokens)
        slots = spec_slots(
            spec.block_ids, spec.groups, self.engine.layout.slot_block_sizes, n, spec.skip, n
        )
        return torch.from_numpy(slots)

    def _run(self, spec: SaveSpec | VerifySpec | ReceiptSpec, ready: Marker, keep: Any) -> int:
        """One saver job: a check, a receipt, or a save (tokens stored)."""
        if isinstance(spec, VerifySpec):
            self.verify.run(spec, ready)
            return 0
        if isinstance(spec, ReceiptSpec):
            storage, keys = self.engine.storage, self.engine.keys
            written = write_receipt(storage, keys, spec.receipt, spec.scope)
            self._count(receipts_written=int(written), receipts_unwritten=int(not written))
            return 0
        t0 = time.perf_counter()
        n = self.engine.store(
            spec.tokens, self._slots(spec), scope=spec.scope, ready=ready, keep=keep
        )
        for boundary, blocks in spec.states:  # a Mamba hybrid's states (kvtier.core.engine.states)
            self.engine.store_state(
                spec.tokens, boundary, blocks, scope=spec.scope, ready=ready, keep=keep
            )
        self.metrics.observe("save_seconds", time.perf_counter() - t0)
        return n

    def _done(self, tokens: int, failed: bool) -> None:
        self._count(save_jobs=1, saved_tokens=tokens, save_errors=int(failed))

    def save_layer(self, layer_name: str, meta: KVTierMetadata) -> None:
        """``save_kv_layer`` with ``use_layerwise``: capture one layer of the step's saves."""
        if self.layer_of.get(layer_name) == 0:
            self._store_gens = [
                self.engine.store_layerwise(s.tokens, self._slots(s), scope=s.scope)
                for s in meta.saves
            ]
            self._count(save_jobs=len(meta.saves))
        for gen in self._store_gens:
            next(gen, None)

    def submit(self, meta: KVTierMetadata, unfilled: Set[str] = frozenset()) -> None:
        """``wait_for_save``: hand the step's lazy saves, checks and saves to the saver.
        ``unfilled``: requests whose load before this step's forward pass left blocks unfilled
        (vLLM recomputes them): their saves of this step would store those blocks, so they are
        not made (the scheduler saves them after the recompute); the requests still finish as
        if they were (``finished``)."""
        platform = self.engine.platform
        # Freed by vLLM already (their saves were copied): never reported in finished_sending.
        self._saving.difference_update(meta.unheld)
        if meta.lazy_saves:
            # Blocks of finished requests, touched by the scheduler until reported copied; the
            # marker orders the copy after any device work still writing them.
            self._lazy.update(spec.req_id for spec in meta.lazy_saves)
            self.saver.submit(meta.lazy_saves, platform.record_marker(), meta.step)
        # The scheduler holds the blocks of every request with a save (or a check) until
        # get_finished says so.
        self._saving.update(spec.req_id for spec in meta.saves)
        self._saving.update(spec.req_id for spec in meta.verifies)
        if meta.verifies:
            # Before this step's saves: a chunk found wrong is removed, and saved afresh.
            self.saver.submit(meta.verifies, platform.record_marker(), meta.step)
        if self.config.use_layerwise:
            gens, self._store_gens = self._store_gens, []
            before = self.engine.stats.stored_tokens
            for gen in gens:
                for _ in gen:
                    pass
            self._count(saved_tokens=self.engine.stats.stored_tokens - before)
        elif meta.saves:
            saves = [spec for spec in meta.saves if spec.req_id not in unfilled]
            if len(saves) < len(meta.saves):
                self._count(saves_dropped=len(meta.saves) - len(saves))
            # On the thread and stream of vLLM's forward pass: the saver's copies wait for it.
            self.saver.submit(saves, platform.record_marker(), meta.step)
        if meta.receipts:  # after the saves, on the same thread
            self.saver.submit(meta.receipts, platform.record_marker(), meta.step)
        self.saver.mark(meta.step)  # layer-wise saves are copied already

    def before_reuse(self) -> None:
        """A preempted request's blocks are reused by this step: finish reading them first (a
        save still copying when the drain times out is abandoned, never committed)."""
        if not self.saver.drain(SAVE_DRAIN_TIMEOUT_S):
            self._count(saves_abandoned=1)
            logger.error(
                "kvtier: saves did not finish in %.0f s before blocks were reused; "
                "the unfinished ones are abandoned",
                SAVE_DRAIN_TIMEOUT_S,
            )

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Of the finished requests whose blocks kvtier holds, those whose saves are done."""
        self._finishing |= finished_req_ids & self._saving
        if not self._finishing:
            return set()
        done = self._finishing - self.saver.pending(self._finishing)
        self._finishing -= done
        self._saving -= done
        return done

    def lazy_copied(self) -> set[str]:
        """Lazy saves whose copies are done since the last call."""
        done = self._lazy - self.saver.pending(self._lazy)
        self._lazy -= done
        return done

    def close(self) -> None:
        self.saver.close(SAVE_DRAIN_TIMEOUT_S)

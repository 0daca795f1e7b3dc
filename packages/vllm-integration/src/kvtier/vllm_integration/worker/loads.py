"""The worker's loads: from the probe's hold into vLLM's paged cache, counted and checked.

Synchronous loads run before the forward pass (``run``), or layer by layer with
``use_layerwise`` (``wait_for_layer``); on the CPU platform, where the worker has CPUs outside
its binding, layer by layer on a thread there while the forward pass runs
(``worker/layer_pipe.py``). Loads marked ``load_async`` go to the loader thread
(``worker/load_thread.py``) with a device marker of the forward pass and come back through
``take_finished``. A load that fills fewer tokens than asked reports the blocks it left
unfilled (``take_failed``, vLLM's ``get_block_ids_with_load_errors``): with
``kv_load_failure_policy="recompute"`` vLLM recomputes them, with "fail" the request fails.

A load the scheduler answered from its index (``lookup: index``: no hold, ``hold_id`` None)
looks the prompt up and holds it as a probe would (counted the same way), and loads from that;
on the loader thread it first lets in-flight saves of the same prefix land (``before_indexed``;
a synchronous one was answered only for chunks whose saves were copied:
``scheduler/sync_loads.py``). If it comes up short, how much it found goes back to the
scheduler's index (``shortfall``).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from kvtier.core.affinity import background_cpus
from kvtier.core.config import KVTierConfig
from kvtier.core.engine import CacheEngine
from kvtier.core.engine.slots import written
from kvtier.core.memory.handles import Hold, RetrieveJob
from kvtier.core.platform import Marker
from kvtier.vllm_integration.groups import NULL_BLOCK
from kvtier.vllm_integration.messages import LoadSpec, spec_slots
from kvtier.vllm_integration.stats import StatsTracker
from kvtier.vllm_integration.worker.holds import HoldTable
from kvtier.vllm_integration.worker.layer_pipe import LAYER_WAIT_S, LayerPipe
from kvtier.vllm_integration.worker.load_thread import Loader

logger = logging.getLogger("kvtier")


class LoadReports(Protocol):
    """What a worker's loads tell the rest of the worker (``WorkerSide``)."""

    def count(self, **counters: int) -> None:
        """Add to the worker's counters."""
        ...

    def before_indexed_load(self, spec: LoadSpec) -> None:
        """A load the scheduler's index answered is about to look the tiers up (loader thread)."""
        ...

    def load_short(self, req_id: str, found: int) -> None:
        """Such a load found only the prompt's first ``found`` tokens."""
        ...


class WorkerLoads:
    """One worker's loads (see the module docstring)."""

    def __init__(
        self,
        config: KVTierConfig,
        engine: CacheEngine,
        holds: HoldTable,
        *,
        block_size: int,
        layer_of: dict[str, int],
        metrics: StatsTracker,
        reports: LoadReports,
    ) -> None:
        self.config = config
        self.engine = engine
        self.holds = holds
        self.block_size = block_size
        self._layer_of = layer_of
        self._metrics = metrics
        self._reports = reports
        self._jobs: list[RetrieveJob] = []  # this step's layer-wise loads, run inline
        self._piped: list[LoadSpec] = []  # this step's loads on the layer pipe, until finished
        self._failed: set[int] = set()
        # A hybrid model's failed loads go to vLLM as requests (``failed_recving``): vLLM
        # cannot map block ids back to requests when there are several KV cache groups.
        self._by_request = bool(engine.layout.groups or engine.layout.states)
        self._async: dict[str, LoadSpec] = {}  # submitted asynchronous loads, by request
        # Requests whose load before this step's forward pass fell short (``take_unfilled``).
        self._unfilled: set[str] = set()
        self._failed_requests: set[str] = set()
        self._loader = Loader(self._load, self._spec_blocks)
        # The cache is host memory and there are CPUs besides the forward pass's: synchronous
        # loads are copied there layer by layer (a hybrid's keep their path: they load on the
        # loader thread anyway).
        cpus = background_cpus()
        self._pipe = (
            LayerPipe(engine.layout.num_layers)
            if cpus and engine.platform.name == "cpu" and not self._by_request
            else None
        )

    @property
    def in_flight(self) -> int:
        """Asynchronous loads submitted to the loader thread and not finished yet."""
        return self._loader.in_flight

    def _spec_blocks(self, spec: LoadSpec) -> set[int]:
        """The blocks a load was to fill (never vLLM's null block: nothing is loaded there)."""
        first, last = spec.start // self.block_size, -(-spec.end // self.block_size)
        return set(spec.block_ids[first:last]) - {NULL_BLOCK}

    def _check_loaded(self, spec: LoadSpec, mask: torch.Tensor, slots: torch.Tensor) -> set[int]:
        """Count a load; return the blocks it left unfilled (reported to vLLM). Tokens that
        have no slot in any group (vLLM's null block: a window group's blocks before a hit's
        window) are not asked for."""
        asked = written(slots)[spec.start : spec.end]
        requested = int(asked.sum())
        want = mask[spec.start : spec.end] | ~asked
        loaded = int((want & asked).sum())
        self._reports.count(load_requests=1, load_tokens_requested=requested, loaded_tokens=loaded)
        logger.debug(
            "kvtier: request %s: loaded %d of tokens %d-%d",
            spec.req_id,
            loaded,
            spec.start,
            spec.end,
        )
        if bool(want.all()):
            return set()
        missing = (~want).nonzero().squeeze(1) + spec.start
        if spec.hold_id is None:
            self._reports.load_short(spec.req_id, int(missing[0]))
        blocks = {spec.block_ids[int(i) // self.block_size] for i in missing}
        logger.warning(
            "kvtier: request %s: %d of %d tokens could not be loaded; %d block(s) "
            "reported failed to vLLM (its kv_load_failure_policy recomputes them or "
            "fails the request)",
            spec.req_id,
            requested - loaded,
            requested,
            len(blocks),
        )
        self._reports.count(load_failed_blocks=len(blocks))
        return blocks

    def _slots(self, spec: LoadSpec) -> torch.Tensor:
        return torch.from_numpy(
            spec_slots(
                spec.block_ids,
                spec.groups,
                self.engine.layout.slot_block_sizes,
                len(spec.tokens),
                spec.start,
                spec.end,
            )
        )

    def _index_hold(self, spec: LoadSpec) -> Hold | None:
        """A load the scheduler's index answered (no probe's hold): the prompt looked up and held
        here, counted as a probe's lookup (the caller releases it). None for any other load."""
        if spec.hold_id is not None:
            return None
        if spec.load_async:
            # A synchronous one was answered only for chunks whose saves were copied.
            self._reports.before_indexed_load(spec)
        return self.engine.hold(spec.tokens, spec.scope)

    def _load(self, spec: LoadSpec, hold: Hold | None, ready: Marker) -> set[int]:
        """One whole load, on the loader thread or before the forward pass (the caller releases
        the hold); returns the blocks it left unfilled."""
        own = self._index_hold(spec)
        if own is not None:
            hold = own
        slots = self._slots(spec)
        try:
            t0 = time.perf_counter()
            mask = self.engine.retrieve(
                spec.tokens,
                slots,
                scope=spec.scope,
                hold=hold,
                ready=ready,
                state_blocks=spec.states,
            )
            self._metrics.observe("load_seconds", time.perf_counter() - t0)
        finally:
            if own is not None:
                own.release()
        return self._check_loaded(spec, mask, slots)

    def run(self, loads: list[LoadSpec]) -> None:
        """This step's loads (``start_load_kv``), each from its probe's hold."""
        marker = self.engine.platform.record_marker() if loads else None
        # The layer pipe takes the step's synchronous loads if it is free (decided once a step:
        # its batch is this step's whole).
        piped = self._pipe is not None and not self._pipe.busy
        batch: list[tuple[LoadSpec, RetrieveJob]] = []  # the pipe's
        for spec in loads:
            hold = self.holds.take(spec.req_id, spec.hold_id)
            if spec.hold_id is None:
                self._reports.count(indexed_loads=1)  # answered by the scheduler's index: no hold
            elif hold is None:
                # Expired before its load: read the tiers (may come up short).
                self._reports.count(loads_without_hold=1)
            if spec.load_async:
                self._async[spec.req_id] = spec
                self._loader.submit(spec, hold, marker)
                continue
            try:
                if piped or self.config.use_layerwise:
                    failed, job = self._plan_layers(spec, hold)
                    if job is not None and piped:
                        batch.append((spec, job))
                    elif job is not None:
                        self._jobs.append(job)
                else:
                    try:
                        failed = self._load(spec, hold, None)
                    except Exception:  # recomputed by vLLM (or failed, by its policy)
                        logger.exception("kvtier: loading request %s failed", spec.req_id)
                        failed = self._spec_blocks(spec)
                self._fail(spec, failed)
            finally:
                if hold is not None:
                    hold.release()
        if batch:
            assert self._pipe is not None
            self._piped = [spec for spec, _ in batch]
            self._pipe.submit([(spec.req_id, job.layers) for spec, job in batch])

    def _plan_layers(
        self, spec: LoadSpec, hold: Hold | None
    ) -> tuple[set[int], RetrieveJob | None]:
        """Plan a layer-wise load of ``spec`` (the retrieval takes its own references to the held
        objects, so the hold can go now): the blocks it will leave unfilled, and the job (None
        if planning failed)."""
        own = None
        try:
            own = self._index_hold(spec)
            if own is not None:
                hold = own
            slots = self._slots(spec)
            job = self.engine.retrieve_layerwise(spec.tokens, slots, scope=spec.scope, hold=hold)
        except Exception:  # recomputed by vLLM (or failed, by its policy)
            logger.exception("kvtier: loading request %s failed", spec.req_id)
            return self._spec_blocks(spec), None
        finally:
            if own is not None:
                own.release()
        return self._check_loaded(spec, job.mask, slots), job

    def _fail(self, spec: LoadSpec, blocks: set[int]) -> None:
        """``spec``'s load left ``blocks`` unfilled: reported to vLLM, and the step's save of its
        request is not made (``take_unfilled``)."""
        self._failed |= blocks
        if blocks:
            self._unfilled.add(spec.req_id)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the asynchronous loads in flight (``Loader.wait_idle``)."""
        return self._loader.wait_idle(timeout_s)

    def take_unfilled(self) -> set[str]:
        """Requests whose load before this step's forward pass left blocks unfilled (vLLM
        discards the step's output of them and recomputes): their saves of this step would
        store those blocks, so they are not made (``WorkerSaves.submit``)."""
        out, self._unfilled = self._unfilled, set()
        return out

    def wait_for_layer(self, layer_name: str) -> None:
        """Layer-wise loads: this layer's KV is in place (all of it after the last layer)."""
        layer = self._layer_of.get(layer_name)
        last = layer == len(self._layer_of) - 1
        if self._piped:
            assert self._pipe is not None
            # After the last layer, or a wait that timed out: the batch's end (reported failed if
            # it does not come either).
            if layer is not None and (last or not self._pipe.wait_layer(layer, LAYER_WAIT_S)):
                self.finish()
            return
        if not self._jobs:
            return
        for job in self._jobs:
            next(job.layers, None)
        if last:
            self.finish()

    def finish(self) -> None:
        """Run every layer-wise load to its end (wait for the layer pipe's)."""
        if self._piped:
            assert self._pipe is not None
            piped, self._piped = self._piped, []
            self._reports.count(layer_pipe_loads=len(piped))
            ended, failed, seconds = self._pipe.finish(LAYER_WAIT_S)
            if not ended:
                logger.error(
                    "kvtier: a synchronous load's copy took over %.0f s; its %d load(s) are "
                    "reported failed (vLLM recomputes them)",
                    LAYER_WAIT_S,
                    len(piped),
                )
            for spec in piped:
                if not ended or spec.req_id in failed:
                    blocks = self._spec_blocks(spec)
                    self._fail(spec, blocks)
                    self._reports.count(load_failed_blocks=len(blocks))
                else:
                    self._metrics.observe("load_seconds", seconds)
            return
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            for _ in job.layers:
                pass

    def take_failed(self) -> set[int]:
        """Blocks loads left unfilled since the last call."""
        failed, self._failed = self._failed, set()
        return failed

    def take_finished(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose asynchronous loads finished (their failed blocks join ``take_failed``),
        after waiting up to ``wait_s`` for those submitted since the last call
        (``worker/load_thread.py``)."""
        done, failed = self._loader.take_finished(wait_s)
        specs = [self._async.pop(rid, None) for rid in done]
        if not self._by_request:
            self._failed |= failed
            return done
        for spec in specs:
            if spec is not None and failed & self._spec_blocks(spec):
                self._failed_requests.add(spec.req_id)
        return done

    def take_failed_requests(self) -> set[str]:
        """A hybrid model's requests whose asynchronous loads failed since the last call
        (vLLM's ``failed_recving``: it recomputes them from the start, or fails them)."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def close(self, timeout_s: float) -> None:
        self._loader.close(timeout_s)
        if self._pipe is not None:
            self._pipe.close(timeout_s)

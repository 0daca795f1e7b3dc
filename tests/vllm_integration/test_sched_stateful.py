"""Hypothesis drives the scheduler half (``SchedulerSide``) against real worker parts
(``sched_harness.py`` plus each rank's real ``WorkerLoads``) through random interleavings of
arrivals, lookups, probes, loads, runs (prefill and save), finishes and aborts, host-memory
drops and cache resets, over a few prompts sharing prefixes, two salts, probe and index lookups,
sync and async loads, with and without tail blocks, on one and two ranks.

Each rank's fake paged cache holds, in every slot a request computed, a value derived from the
rank, the salt, the weights generation and the prompt's tokens up to that position (the same in
every head, shifted per layer and K/V), so a load that brings another prompt's (or salt's,
generation's, rank's, layer's) KV is seen. Checked: a hit is whole blocks, at most the prompt's
last block boundary before its last token, and never longer than the prefix some save of the
same salt and generation shared with the prompt; every loaded slot holds the requesting
prompt's value (a slot a short load left unfilled keeps its poison and its block is reported
failed; only ``lookup: index`` or a reset may come up short); nothing outside the load's span
changes; and once every request finished, no rank holds anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from sched_harness import BLOCK, CACHE_BLOCKS, CHUNK, Harness, empty_output, request
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.request import Request

from kvtier.vllm_integration.messages import KVTierMetadata, LoadSpec, slot_mapping
from kvtier.vllm_integration.stats import StatsTracker
from kvtier.vllm_integration.worker.feed import PresenceFeed
from kvtier.vllm_integration.worker.loads import WorkerLoads

HEADS, HEAD = 2, 8  # the harness's layout
POISON = -7.0  # never a painted value (those are 0..255)
WAIT_S = 60.0  # the loader thread has this long to finish a step's loads (a hang guard only)


def _seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


A, B = _seq(1000, 2 * CHUNK + BLOCK), _seq(3000, 2 * CHUNK)
PROMPTS = (
    A[: 2 * CHUNK] + _seq(20000, BLOCK + 5),  # two chunks, a block, an odd tail
    A[: 2 * CHUNK] + _seq(21000, CHUNK),  # same two chunks, another whole chunk
    A[: CHUNK + BLOCK] + _seq(22000, 2 * BLOCK + 1),  # leaves A a block into its second chunk
    A[: CHUNK + BLOCK + 9] + _seq(23000, 9),  # leaves A inside a block
    A[: BLOCK + 1],  # one block at most
    B + _seq(24000, 3),
    B[:CHUNK] + _seq(25000, BLOCK),  # whole blocks: the last one is always recomputed
)
SALTS = (None, "a")

# Cache element -> (slot, K or V) for the vllm_cpu layout [blocks, heads, BLOCK, 2 * HEAD]:
# per (block, head) K is stored transposed ([HEAD, BLOCK]), then V as [BLOCK, HEAD].
_IDX = torch.arange(2 * HEAD * BLOCK)
_KV = (_IDX >= HEAD * BLOCK).long()
_OFF = torch.where(_KV == 0, _IDX % BLOCK, (_IDX - HEAD * BLOCK) // HEAD)
SHAPE = (CACHE_BLOCKS, HEADS, BLOCK, 2 * HEAD)
ELEM_SLOT = (
    (torch.arange(CACHE_BLOCKS)[:, None, None] * BLOCK + _OFF)
    .expand(CACHE_BLOCKS, HEADS, -1)
    .reshape(SHAPE)
)
ELEM_KV = _KV.expand(CACHE_BLOCKS, HEADS, -1).reshape(SHAPE)


@lru_cache(maxsize=4096)
def token_values(
    rank: int, salt: str | None, gen: str | None, tokens: tuple[int, ...]
) -> list[int]:
    """The value (0..63) of each position of ``tokens``: a hash of everything its KV depends on."""
    h = hashlib.blake2b(f"{rank}|{salt}|{gen}".encode(), digest_size=8)
    out = []
    for t in tokens:
        h.update(t.to_bytes(8, "little"))
        out.append(h.copy().digest()[0] % 64)
    return out


def paint(caches: list[torch.Tensor], slots: list[int], values: list[float]) -> None:
    """Write ``values`` (one per slot) into every head, layer (+64 each) and K/V (+128) of those
    slots of a rank's paged cache."""
    if not slots:
        return
    per_slot = torch.zeros(CACHE_BLOCKS * BLOCK)
    per_slot[torch.tensor(slots)] = torch.tensor(values, dtype=torch.float32)
    chosen = torch.zeros(CACHE_BLOCKS * BLOCK, dtype=torch.bool)
    chosen[torch.tensor(slots)] = True
    mask = chosen[ELEM_SLOT]
    for layer, cache in enumerate(caches):
        shift = torch.where(per_slot[ELEM_SLOT] == POISON, 0.0, 64.0 * (ELEM_KV + 2 * layer))
        cache[mask] = (per_slot[ELEM_SLOT] + shift).to(cache.dtype)[mask]


# Each slot's 2 * HEADS * HEAD elements of a layer, K first: [slots, 2, HEADS * HEAD].
SLOT_ELEMS = torch.argsort(ELEM_SLOT.flatten() * 2 + ELEM_KV.flatten(), stable=True).view(
    CACHE_BLOCKS * BLOCK, 2, HEADS * HEAD
)


def read(caches: list[torch.Tensor], slots: list[int]) -> list[float | None]:
    """Each slot's value as ``paint`` wrote it (None where its elements disagree)."""
    idx = SLOT_ELEMS[torch.tensor(slots, dtype=torch.long)]
    per = []
    for layer, cache in enumerate(caches):
        v = cache.flatten().float()[idx]
        shift = 64.0 * (torch.arange(2)[None, :, None] + 2 * layer)
        per.append(torch.where(v == POISON, v, v - shift))
    vals = torch.cat(per, dim=1).flatten(1)
    same = (vals == vals[:, :1]).all(1)
    return [v if ok else None for v, ok in zip(vals[:, 0].tolist(), same.tolist(), strict=True)]


def slots_of(blocks: list[int], start: int, end: int) -> list[int]:
    return [blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(start, end)]


def lcp(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Live:
    """One request as vLLM sees it."""

    req: Request
    salt: str | None
    gen: str | None  # the weights generation it arrived under: the KV a hit must give
    blocks: list[int]
    computed: int  # vLLM's own prefix-cache hit at the lookup
    phase: str = "asking"  # asking -> loading (async) -> ready -> running
    may_fail: bool = False  # a reset dropped its hold: its load may come up short
    ready_at: int = 0  # tokens it has KV for when it runs

    @property
    def tokens(self) -> list[int]:
        return list(self.req.prompt_token_ids or ())


class Reports:
    """A worker's ``LoadReports``: index-answered loads' shortfalls go to the rank's feed."""

    def __init__(self, feed: PresenceFeed) -> None:
        self.feed = feed

    def count(self, **counters: int) -> None:
        pass

    def before_indexed_load(self, spec: LoadSpec) -> None:
        pass

    def load_short(self, req_id: str, found: int) -> None:
        self.feed.shortfall(req_id, found)


class Machine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.h: Harness | None = None
        self.loads: list[WorkerLoads] = []  # each rank's
        self.live: dict[str, Live] = {}
        self.aborted: dict[str, Live] = {}  # finished, their async loads still due
        self.finished: set[str] = set()  # vLLM's finished_req_ids for the next step
        self.free = list(range(CACHE_BLOCKS))
        self.saved: list[tuple[str | None, str | None, tuple[int, ...]]] = []  # salt, gen, tokens
        self.worker_gen: str | None = None
        self.drops = 0  # host drops (a reset counts two): rare, so that hits are frequent

    @initialize(
        world=st.sampled_from([1, 2]),
        mode=st.sampled_from(["probe", "index"]),
        tails=st.booleans(),
        sync=st.booleans(),
        arena=st.sampled_from([8, 32]),
    )
    def setup(self, world: int, mode: str, tails: bool, sync: bool, arena: int) -> None:
        load_async = mode == "index" or not sync
        self.h = Harness.create(
            world_size=world,
            lookup=mode,
            save_unfull_chunk=tails,
            load_async=load_async,
            arena_chunks=arena,
        )
        for rank in self.h.ranks:
            for c in rank.engine.mover.kv_caches:  # type: ignore[union-attr]
                c.fill_(POISON)
            self.loads.append(
                WorkerLoads(
                    self.h.sched.config,
                    rank.engine,
                    rank.holds,
                    block_size=BLOCK,
                    layer_of={},
                    metrics=StatsTracker(),
                    reports=Reports(rank.feed),
                )
            )

    # -- helpers ---------------------------------------------------------------------------
    def caches(self, rank: int) -> list[torch.Tensor]:
        assert self.h is not None
        return list(self.h.ranks[rank].engine.mover.kv_caches)  # type: ignore[union-attr]

    def paint_kv(self, lv: Live, start: int, end: int, gen: str | None) -> None:
        """The KV of tokens ``[start, end)`` computed into ``lv``'s blocks on every rank."""
        for r in range(len(self.loads)):
            values = token_values(r, lv.salt, gen, tuple(lv.tokens))[start:end]
            paint(self.caches(r), slots_of(lv.blocks, start, end), [float(v) for v in values])

    def bound(self, lv: Live) -> int:
        """The longest prefix of ``lv``'s prompt a save under its salt and generation covered."""
        shared = [lcp(t, lv.tokens) for s, g, t in self.saved if (s, g) == (lv.salt, lv.gen)]
        return max(shared, default=0) // BLOCK * BLOCK

    def answered(self, lv: Live, n: int, load_async: bool) -> None:
        assert self.h is not None
        if lv.gen is not None and lv.gen.startswith("pending-"):
            # It arrived while a reset was being resolved: vLLM's lookup waited for the
            # workers' weights, and the request computes under the generation they gave.
            lv.gen = self.h.sched.generation
            self.paint_kv(lv, 0, lv.computed, lv.gen)
        total, size = lv.computed + n, len(lv.tokens)
        if n:
            assert total % BLOCK == 0, (lv.computed, n)
            assert total <= (size - 1) // BLOCK * BLOCK, (total, size)
            assert total <= self.bound(lv), f"hit {total} > what was stored {self.bound(lv)}"
        blocks = KVCacheBlocks(([KVCacheBlock(b) for b in lv.blocks],))
        if not n:
            lv.phase, lv.ready_at = "ready", lv.computed
            return
        self.h.sched.update_state_after_alloc(lv.req, blocks, n)
        lv.ready_at = total
        if load_async:
            lv.phase = "loading"
        else:  # scheduled now, its load before the forward pass
            lv.phase = "ready"
            self.run_step([lv])

    def check_load(self, lv: Live, spec: LoadSpec, failed: list[set[int]]) -> None:
        """Every rank: the load's span holds the requesting prompt's values (or, in a failed
        block, the poison it had), and nothing else in the request's blocks changed."""
        size = len(lv.tokens)
        first_bad = spec.end
        for r in range(len(self.loads)):
            want = token_values(r, lv.salt, lv.gen, tuple(lv.tokens))
            got = read(self.caches(r), slots_of(lv.blocks, 0, -(-size // BLOCK) * BLOCK))
            for i, v in enumerate(got):
                bad_block = lv.blocks[i // BLOCK] in failed[r]
                if i < lv.computed:
                    ok = v == want[i]
                elif i < spec.end and i >= spec.start:
                    ok = v == want[i] or (bad_block and v == POISON)
                    if v != want[i]:
                        first_bad = min(first_bad, i // BLOCK * BLOCK)
                else:
                    ok = v == POISON
                assert ok, f"rank {r} token {i}: {v}, want {want[i] if i < size else POISON}"
            if failed[r] & set(lv.blocks):
                assert self.h is not None
                assert self.h.sched.lookups.mode == "index" or lv.may_fail, "a held load failed"
        lv.ready_at = min(lv.ready_at, first_bad)  # vLLM recomputes failed blocks

    def run_step(self, scheduled: Sequence[Live] = ()) -> KVTierMetadata:
        """One scheduler step with ``scheduled`` (each from its ``ready_at``), then what each
        worker does with its metadata: releases and probes, loads, the forward pass, saves,
        ``get_finished``; the reports go back."""
        assert self.h is not None
        out = empty_output()
        for lv in scheduled:
            lv.req.num_computed_tokens = lv.ready_at
            out.scheduled_new_reqs.append(NewRequestData.from_request(lv.req, (lv.blocks,)))
            out.num_scheduled_tokens[lv.req.request_id] = len(lv.tokens) - lv.ready_at
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.finished_req_ids, self.finished = self.finished, set()
        meta = self.h.sched.build_connector_meta(out)
        if meta.generation != self.worker_gen:  # the worker drops what older weights computed
            self.worker_gen = meta.generation
            for rank in self.h.ranks:
                rank.holds.close()
                rank.engine.storage.drop_host()
        self.h.deliver(meta)
        failed: list[set[int]] = []
        for loads in self.loads:
            loads.run(meta.loads)
            done = loads.take_finished(WAIT_S)
            assert done == {s.req_id for s in meta.loads if s.load_async}
            failed.append(loads.take_failed())
        for spec in meta.loads:
            lv = self.live.get(spec.req_id) or self.aborted.pop(spec.req_id)
            if spec.load_async and lv.phase == "loading":
                lv.phase = "ready"
            self.check_load(lv, spec, failed)
            if spec.req_id not in self.live:
                self.free.extend(lv.blocks)
        for lv in scheduled:  # the forward pass
            self.paint_kv(lv, lv.ready_at, len(lv.tokens), self.h.sched.generation)
            lv.phase = "running"
        for r, rank in enumerate(self.h.ranks):
            for spec in meta.saves:
                n = len(spec.tokens)
                slots = slot_mapping(spec.block_ids, BLOCK, n, spec.skip, n)
                rank.engine.store(spec.tokens, torch.from_numpy(slots), scope=spec.scope)
                if r == 0:
                    lv = self.live[spec.req_id]
                    self.saved.append((lv.salt, lv.gen, tuple(int(t) for t in spec.tokens)))
            rank.feed.saves_copied(meta.step)
            rank.holds.release_requests(out.finished_req_ids)
        self.h.report()
        return meta

    # -- rules -----------------------------------------------------------------------------
    @precondition(lambda self: self.h is not None and len(self.live) < 4 and len(self.free) >= 7)
    @rule(
        prompt=st.sampled_from(PROMPTS),
        salt=st.sampled_from(SALTS),
        cached=st.sampled_from([0, 0, BLOCK]),
    )
    def arrive(self, prompt: list[int], salt: str | None, cached: int) -> None:
        """A request arrives with ``cached`` tokens in vLLM's prefix cache; vLLM asks once."""
        assert self.h is not None
        nblocks = -(-len(prompt) // BLOCK)
        blocks, self.free = self.free[:nblocks], self.free[nblocks:]
        lv = Live(request(prompt, salt=salt), salt, self.h.sched.generation, blocks, 0)
        for r in range(len(self.loads)):
            paint(self.caches(r), slots_of(blocks, 0, nblocks * BLOCK), [POISON] * nblocks * BLOCK)
        lv.computed = min(cached, (len(prompt) - 1) // BLOCK * BLOCK)
        self.paint_kv(lv, 0, lv.computed, lv.gen)
        self.live[lv.req.request_id] = lv
        self.ask(lv)

    def ask(self, lv: Live) -> None:
        assert self.h is not None
        n, load_async = self.h.sched.get_num_new_matched_tokens(lv.req, lv.computed)
        if n is not None:
            self.answered(lv, n, load_async)

    @precondition(lambda self: self.h is not None and len(self.live) < 4 and len(self.free) >= 7)
    @rule(prompt=st.sampled_from(PROMPTS), salt=st.sampled_from(SALTS))
    def serve(self, prompt: list[int], salt: str | None) -> None:
        """A request arrives and, once vLLM has its answer (and its load), runs."""
        self.arrive(prompt, salt, 0)
        lv = list(self.live.values())[-1]
        for _ in range(3):
            if lv.phase == "asking":
                self.run_step()
                self.ask(lv)
            elif lv.phase == "loading":
                self.run_step()
        if lv.phase == "ready":
            self.start(lv)

    def pick(self, which: int, *phases: str) -> Live | None:
        chosen = [lv for lv in self.live.values() if lv.phase in phases]
        return chosen[which % len(chosen)] if chosen else None

    def has(*phases: str):  # type: ignore[no-untyped-def]
        return lambda self: any(lv.phase in phases for lv in self.live.values())

    @precondition(has("asking"))
    @rule(which=st.integers(0, 3))
    def ask_again(self, which: int) -> None:
        """vLLM asks again about a request whose lookup was "not yet"."""
        lv = self.pick(which, "asking")
        if lv is not None:
            self.ask(lv)

    @precondition(lambda self: self.h is not None)
    @rule()
    def empty_step(self) -> None:
        self.run_step()

    @precondition(has("ready"))
    @rule(which=st.integers(0, 3))
    def run(self, which: int) -> None:
        """A request with all the KV it will get is scheduled: the rest of its prompt is
        computed into its blocks and saved from there."""
        lv = self.pick(which, "ready")
        assert lv is not None
        self.start(lv)

    def start(self, lv: Live) -> None:
        assert self.h is not None
        self.h.sched.update_state_after_alloc(lv.req, None, 0)  # type: ignore[arg-type]
        self.run_step([lv])

    @precondition(has("asking", "loading", "ready", "running"))
    @rule(which=st.integers(0, 3))
    def finish(self, which: int) -> None:
        """A request finishes or is aborted, whatever its phase (a load still due keeps its
        blocks until the load is done)."""
        lv = self.pick(which, "asking", "loading", "ready", "running")
        if lv is None:
            return
        assert self.h is not None
        rid = lv.req.request_id
        if lv.phase == "running":
            lv.req.num_computed_tokens = len(lv.tokens)
        self.h.sched.request_finished(lv.req, lv.blocks)
        del self.live[rid]
        self.finished.add(rid)
        if lv.phase == "loading":
            self.aborted[rid] = lv
        else:
            self.free.extend(lv.blocks)

    @precondition(lambda self: self.h is not None and self.drops < 2)
    @rule(rank=st.integers(0, 1))
    def drop_host(self, rank: int) -> None:
        """One rank's host memory loses everything (its tier evicted it, or it restarted)."""
        assert self.h is not None
        self.drops += 1
        self.h.ranks[rank % len(self.h.ranks)].engine.storage.drop_host()
        self.h.report()

    @precondition(lambda self: self.h is not None and not self.drops)
    @rule()
    def reset(self) -> None:
        """A weight update: nothing stored before is served again."""
        assert self.h is not None
        self.drops += 2
        # New weights on every rank: the reset starts the generation they name.
        self.h.live = [f"weights-{self.drops}"] * len(self.h.ranks)
        self.h.sched.reset_cache()
        for lv in [*self.live.values(), *self.aborted.values()]:
            lv.may_fail = True

    def teardown(self) -> None:
        if self.h is None:
            return
        try:
            while self.live:
                self.finish(0)
            self.run_step()
            self.run_step()
            assert not self.aborted
            for r, rank in enumerate(self.h.ranks):
                assert rank.holds.stats()["holds"] == 0, f"rank {r}: {rank.holds.stats()}"
                assert self.loads[r].in_flight == 0
        finally:
            for loads in self.loads:
                loads.close(WAIT_S)
            self.h.close()


def test_painted_values_are_each_tokens_kv_to_the_engine() -> None:
    """The machine's index math: what ``paint`` writes into a token's slot is that token's K
    and V in the chunk the engine stores, and a load into other blocks reads back the same."""
    h = Harness.create(save_unfull_chunk=True)
    try:
        engine, tokens = h.ranks[0].engine, PROMPTS[1]
        caches = list(engine.mover.kv_caches)  # type: ignore[union-attr]
        values = token_values(0, None, None, tuple(tokens))
        src, dst = [9, 3, 20, 4, 11, 7], [40, 33, 50, 61, 35, 42]
        paint(caches, slots_of(dst, 0, len(tokens)), [POISON] * len(tokens))
        paint(caches, slots_of(src, 0, len(tokens)), [float(v) for v in values])
        assert read(caches, slots_of(src, 0, len(tokens))) == values
        n = len(tokens)
        assert engine.store(tokens, torch.from_numpy(slot_mapping(src, BLOCK, n, 0, n))) == n
        hold = engine.hold(tokens)
        try:
            for span, obj in zip(hold.spans, hold.objs, strict=True):
                # [blocks, layers, page]: each page is its cache block's bytes, as painted
                for j in range(span.num_tokens // BLOCK):
                    block = src[span.start // BLOCK + j]
                    for layer, cache in enumerate(caches):
                        page = cache[block].contiguous().view(torch.uint8).flatten()
                        assert torch.equal(obj.tensor[j, layer], page)
        finally:
            hold.release()
        end = (n // BLOCK - 1) * BLOCK  # whole blocks, one short of what is stored
        slots = slot_mapping(dst, BLOCK, n, BLOCK, end)
        assert bool(engine.retrieve(tokens, torch.from_numpy(slots))[BLOCK:end].all())
        got = read(caches, slots_of(dst, 0, n))
        assert got == [POISON] * BLOCK + values[BLOCK:end] + [POISON] * (n - end)
    finally:
        h.close()


def test_hits_load_the_requesting_prompts_kv_and_nothing_leaks() -> None:
    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )

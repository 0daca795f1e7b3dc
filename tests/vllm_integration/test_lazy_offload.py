"""Lazy offload (``offload: lazy``): a finished request's chunks are copied only when vLLM is
about to evict their blocks, never from a block vLLM has reused.

The first tests drive the scheduler side against a real vLLM ``BlockPool`` and real worker
parts (``sched_harness.py``); the last ones run real vLLM engines on CPU with a small KV cache.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from prompts import DOC, FULL_HIT, STATS, gen
from sched_harness import BLOCK, CHUNK, Harness, block_hasher, request

from kvtier.core import load_config
from kvtier.core.errors import ConfigError

# 4 chunks and one token: 8 full blocks and a partial one; a repeat can hit 256 tokens.
PROMPT = list(range(1000, 1000 + 4 * CHUNK + 1))
FULL = 4 * CHUNK
TARGET_TOKENS = 2 * BLOCK  # max_num_batched_tokens: the 4 blocks at the head are "near eviction"


def lazy_harness(pool_blocks: int) -> Harness:
    return Harness.create(
        pool_blocks=pool_blocks, max_num_batched_tokens=TARGET_TOKENS, offload="lazy"
    )


def filler(n_blocks: int, seed: int) -> list[int]:
    return [5000 + seed * 1000 + i for i in range(n_blocks * BLOCK)]


def stored_tokens(h: Harness) -> int:
    return h.ranks[0].engine.stats.stored_tokens


def test_offload_is_validated_naming_the_field() -> None:
    assert load_config(env={}, overrides={}).offload == "eager"
    with pytest.raises(ConfigError, match="offload"):
        load_config(env={}, overrides={"offload": "sometimes"})


def test_a_prompt_is_copied_only_near_eviction_and_then_served() -> None:
    h = lazy_harness(pool_blocks=40)
    try:
        hasher = block_hasher()
        a = request(PROMPT, block_hasher=hasher)
        h.finish(a, h.run(a))
        for _ in range(3):
            assert h.step().lazy_saves == []
        assert stored_tokens(h) == 0  # vLLM still caches it far from eviction: no bytes moved
        # Other requests take the blocks at the head of vLLM's free queue until the prompt's
        # blocks are among the next ones vLLM evicts.
        seed = 0
        while not h.sched.stats["lazy_saves"]:
            seed += 1
            assert seed < 10, "the prompt never neared eviction"
            r = request(filler(4, seed), block_hasher=hasher)
            h.finish(r, h.run(r))
        assert stored_tokens(h) == FULL  # the prompt's chunks, once
        assert h.sched.stats["lazy_saves"] == 1
        # Evicted from vLLM's cache (its blocks reused): kvtier serves it.
        for _ in range(4):
            r = request(filler(8, 100 + seed), block_hasher=hasher)
            seed += 1
            h.finish(r, h.run(r))
        assert h.hit(request(PROMPT)) == FULL
    finally:
        h.close()


def _prompt_then_filler(h: Harness) -> list:
    """Run the prompt (blocks 1-9) and a request holding blocks 9-14 (its partial block went
    first); the free queue is then blocks 15-19 followed by the prompt's, last block first.
    Returns the prompt's blocks."""
    hasher = block_hasher()
    a = request(PROMPT, block_hasher=hasher)
    blocks = h.run(a)
    h.finish(a, blocks)
    h.run(request(filler(6, 1), block_hasher=hasher))  # running: its blocks stay taken
    assert h.sched.stats["lazy_saves"] == 0
    return blocks


def test_a_block_reused_before_its_copy_is_never_stored_or_served() -> None:
    h = lazy_harness(pool_blocks=20)
    try:
        blocks = _prompt_then_filler(h)
        # The step that brings the prompt near eviction reuses its last full block (now holding
        # another request's KV) together with blocks 15-19.
        reused = h.run(request(filler(6, 7), block_hasher=block_hasher()))
        assert blocks[-2].block_id in {b.block_id for b in reused}
        # The save stops before the reused block: 3 chunks and one tail block.
        assert h.sched.stats["lazy_saves"] == 1
        assert h.sched.stats["lazy_reused_blocks"] == 1
        assert stored_tokens(h) == FULL - BLOCK
        assert h.hit(request(PROMPT)) == FULL - BLOCK
    finally:
        h.close()


def test_blocks_being_copied_cannot_be_reused_until_the_copy_is_done() -> None:
    h = lazy_harness(pool_blocks=20)
    try:
        blocks = _prompt_then_filler(h)
        full = blocks[: FULL // BLOCK]
        assert all(b.block_hash is not None for b in full)
        # Blocks 15 and 16 go: the prompt's blocks are among the next 4; the copy is still running.
        h.run(request(filler(2, 7), block_hasher=block_hasher()), copy=False)
        assert h.sched.stats["lazy_saves"] == 1 and h.in_copy
        assert all(b.ref_cnt == 1 for b in full)
        assert h.sched.has_pending_block_frees()
        assert h.pool is not None
        taken = h.pool.get_new_blocks(h.pool.get_num_free_blocks())
        assert not {b.block_id for b in taken} & {b.block_id for b in full}
        h.pool.free_blocks(taken)
        h.copy_lazy()
        h.step()  # the workers report the copy done: the blocks go back to vLLM
        assert not h.sched.has_pending_block_frees()
        assert all(b.ref_cnt == 0 for b in full)
        assert stored_tokens(h) == FULL
        assert h.hit(request(PROMPT)) == FULL
    finally:
        h.close()


def test_a_request_finishing_into_a_short_free_queue_is_taken_at_once() -> None:
    """Fewer free blocks than the window when it finishes: the next step could allocate its
    blocks before any walk, so they are touched as it finishes and copied next step."""
    h = lazy_harness(pool_blocks=12)
    try:
        a = request(PROMPT, block_hasher=block_hasher())
        blocks = h.run(a)
        assert h.pool is not None and h.pool.get_num_free_blocks() < 4
        h.finish(a, blocks)
        full = blocks[: FULL // BLOCK]
        assert all(b.ref_cnt == 1 for b in full)  # vLLM freed them; the copy holds them
        assert [len(s.tokens) for s in h.step().lazy_saves] == [FULL]
        h.step()  # copied, reported: back to vLLM
        assert all(b.ref_cnt == 0 for b in full)
        assert stored_tokens(h) == FULL
    finally:
        h.close()


def test_worker_reports_of_copies_done_aggregate_over_ranks() -> None:
    """vLLM aggregates every worker's report into one: each rank's finished copies survive,
    with or without the ranks' index reports, and a lazy save counts as copied only once every
    rank reported it."""
    from kvtier.vllm_integration.messages import KVTierWorkerMeta, LazyWorkerMeta, RankReport

    report = RankReport(1, ("m", "fp", 2, 1), True, 10, added=["d"])
    merged = LazyWorkerMeta({}, {0: ["a", "b"]}).aggregate(LazyWorkerMeta({1: report}, {1: ["a"]}))
    assert isinstance(merged, LazyWorkerMeta)
    assert merged.saved == {0: ["a", "b"], 1: ["a"]}
    assert merged.reports[1].added == ["d"]
    plain = LazyWorkerMeta({}, {0: ["a"]}).aggregate(KVTierWorkerMeta({1: report}))
    assert isinstance(plain, LazyWorkerMeta) and plain.saved == {0: ["a"]}

    h = Harness.create(
        world_size=2, pool_blocks=12, max_num_batched_tokens=TARGET_TOKENS, offload="lazy"
    )
    try:
        a = request(PROMPT, block_hasher=block_hasher())
        blocks = h.run(a)
        h.finish(a, blocks)  # a short free queue: its save starts now
        meta = h.step(copy=False)
        (spec,) = meta.lazy_saves
        h.copied = {0: [spec.req_id]}  # rank 0 is done, rank 1 still copying
        h.report()
        assert h.sched.has_pending_block_frees() and blocks[0].ref_cnt == 1
        h.copied = {1: [spec.req_id]}
        h.report()
        assert not h.sched.has_pending_block_frees() and blocks[0].ref_cnt == 0
    finally:
        h.close()


def test_remembered_saves_are_bounded_by_the_size_of_vllms_cache() -> None:
    """Saves of more blocks than twice vLLM's cache are of blocks it has reused since: the
    oldest are forgotten, so finished prompts never pile up."""
    h = lazy_harness(pool_blocks=40)
    try:
        hasher = block_hasher()
        a = request(PROMPT, block_hasher=hasher)
        blocks = h.run(a)
        h.finish(a, blocks)
        assert h.pool is not None
        for _ in range(11):  # the same prompt again: vLLM's prefix cache gives it the blocks
            r = request(PROMPT, block_hasher=hasher)
            h.pool.touch(blocks)
            h.deliver(h.prefill(r, [b.block_id for b in blocks]))
            h.finish(r, blocks)
        lazy = h.sched.lazy
        assert lazy is not None
        # 8 blocks watched per prompt, at most 80 blocks: 10 prompts remembered, 2 forgotten.
        assert (lazy.remembered, lazy.stats["lazy_forgotten"]) == (10, 2)
        assert stored_tokens(h) == 0
    finally:
        h.close()


def test_eager_mode_saves_while_the_request_runs() -> None:
    """The control: eager offload copies the prompt in its first step, evicted or not."""
    h = Harness.create(pool_blocks=40, max_num_batched_tokens=TARGET_TOKENS)
    try:
        a = request(PROMPT, block_hasher=block_hasher())
        meta = h.prefill(a)
        assert [len(s.tokens) for s in meta.saves] == [len(PROMPT)]
        assert meta.lazy_saves == []
    finally:
        h.close()


# -- real vLLM on CPU ---------------------------------------------------------------------------

# Prompts that push DOC out of a 300-block vLLM cache: 4 x 110 blocks.
FILLERS = [[3 + (7919 * i + 104729 * k) % 2990 for i in range(3500)] for k in range(1, 5)]


@pytest.mark.vllm
@pytest.mark.parametrize("offload", ["eager", "lazy"])
def test_a_cached_prompt_moves_no_bytes_and_an_evicted_one_is_served(
    run_engine, reference, hit_reference, offload
) -> None:
    """vLLM's prefix cache on, 300 blocks (vLLM's window of blocks about to be evicted is 256:
    2 x its 4096 batched tokens). DOC runs twice (the second time from vLLM's own cache), then
    other prompts evict it, then it runs again. Lazy: nothing is copied while vLLM caches DOC;
    it is copied as it nears eviction and then served by kvtier. Eager (the control) copies it
    in its first run."""
    fill = [{**gen(f), "max_tokens": 1} for f in FILLERS]
    steps = [gen(DOC), STATS, gen(DOC), STATS, *fill, STATS, gen(DOC), STATS]
    config = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25, "offload": offload}
    out = run_engine(
        {"kvtier": config, "prefix_caching": True, "num_gpu_blocks_override": 300, "steps": steps}
    )
    first, cached, evicted = out[0], out[2], out[-2]
    after_cached, before_last, last = out[3], out[-3], out[-1]
    # Tokens and logprobs, exactly: the repeat served by vLLM's cache and the one served by
    # kvtier hit the same blocks.
    assert first == reference["doc"]
    assert cached == evicted == hit_reference["doc"]
    assert after_cached["loaded_tokens"] == 0  # the repeat came from vLLM's own cache
    if offload == "lazy":
        assert after_cached["saved_tokens"] == 0  # cached by vLLM: no bytes moved
    else:
        assert after_cached["saved_tokens"] >= FULL_HIT
    assert before_last["saved_tokens"] >= FULL_HIT  # copied before vLLM evicted it
    assert last["loaded_tokens"] - before_last["loaded_tokens"] == FULL_HIT
    assert last["load_failed_blocks"] == 0 and last["save_errors"] == 0
    print(f"offload={offload}: saved tokens {last['saved_tokens']}")


@pytest.mark.vllm
def test_lazy_offload_without_prefix_caching_fails_at_start(run_engine) -> None:
    with pytest.raises(AssertionError, match="offload"):
        run_engine({"kvtier": {"offload": "lazy"}, "prefix_caching": False, "steps": []})


# -- what a save tells the index before it lands (eager and lazy saves alike) -------------------


def test_a_save_in_flight_makes_a_prompt_diverging_inside_its_chunk_probed() -> None:
    """The scheduler counts what a save it asked for will store, aliases included: a prompt
    that shares only the first block of the first chunk is probed (and its probe waits for the
    save) instead of answered 0 before the workers report the chunk."""
    h = Harness.create()
    try:
        h.prefill(request(PROMPT))  # the save is asked for; nothing stored or reported yet
        diverging = PROMPT[: BLOCK + 5] + [7] * (2 * CHUNK)
        assert h.sched.get_num_new_matched_tokens(request(diverging), 0) == (None, False)
    finally:
        h.close()

"""``lookup: index`` through real vLLM on CPU (``kv_load_failure_policy="recompute"``, where
``lookup: auto`` picks it): hits answered by the scheduler's index, loaded without a hold.

The hazard it brings: nothing holds a chunk between the answer and its load, so a chunk evicted
in between makes the load come up short. vLLM must then recompute those blocks, and the output
must still equal vLLM without kvtier (tokens and logprobs exactly: the whole prompt is
recomputed). A hit equals vLLM's own prefix cache hitting the same blocks (``hit_reference``),
tokens and logprobs exactly, whether it loads before the forward pass of its first step or on
the loader thread.
"""

from __future__ import annotations

import pytest
from prompts import DOC, FULL_HIT, SHARED, STATS, gen

pytestmark = [pytest.mark.vllm]

CONFIG = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.1}


@pytest.mark.parametrize("sync_load_mb", [None, 0.0], ids=["before-forward", "loader-thread"])
def test_index_answers_hit_and_a_chunk_evicted_before_its_load_is_recomputed(
    run_engine, reference, hit_reference, sync_load_mb
) -> None:
    """The hit loads before the forward pass of its first step (a hit in host memory, the
    default) or on the loader thread (``sync_load_mb: 0``). Before the forward pass, the step
    that finds the chunks evicted also saves the request: that save is dropped, and the
    recompute saves the prompt again (without that, the next hits loaded the unfilled blocks
    and answered otherwise)."""
    config = CONFIG if sync_load_mb is None else {**CONFIG, "sync_load_mb": sync_load_mb}
    steps = [
        gen(DOC),
        STATS,  # cold
        gen(DOC),
        STATS,  # full hit, answered by the index
        {**gen(DOC), "evict_after_lookup": True},
        STATS,  # answered, then every chunk evicted before the load: recomputed
        gen(DOC),
        STATS,  # the recompute stored them again: a hit
        gen(DOC),
        STATS,
        gen(SHARED),
        STATS,  # partial-prefix hit
    ]
    out = run_engine({"kvtier": config, "load_failure_policy": "recompute", "steps": steps})
    evict = out[4].pop("evict")
    cold, hit, evicted, again, last, shared = (out[i] for i in (0, 2, 4, 6, 8, 10))
    s_cold, s_hit, s_evicted, s_again, s_last, s_shared = (out[i] for i in (1, 3, 5, 7, 9, 11))
    # Tokens and logprobs, exactly. The evicted one loaded nothing: all of it was recomputed.
    assert cold == evicted == reference["doc"]
    assert hit == again == last == hit_reference["doc"]
    assert shared == hit_reference["shared"]

    assert s_cold["indexed_loads"] == 0 and s_cold["loaded_tokens"] == 0
    assert s_hit["indexed_loads"] == 1 and s_hit["loaded_tokens"] == FULL_HIT
    assert s_hit["holds"] == s_hit["held_objects"] == 0
    # Nothing held the chunks: the filler evicted all of them, and the load found none.
    assert evict["stored"] == evict["evicted"] > 0
    assert s_evicted["indexed_loads"] == 2
    assert s_evicted["loaded_tokens"] == s_hit["loaded_tokens"]
    assert s_evicted["load_failed_blocks"] == FULL_HIT // 32
    # The recompute saved what the load missed: the next request hits all of it again.
    assert s_again["loaded_tokens"] - s_evicted["loaded_tokens"] == FULL_HIT
    assert s_last["loaded_tokens"] - s_again["loaded_tokens"] == FULL_HIT
    assert s_shared["loaded_tokens"] > s_last["loaded_tokens"]
    assert s_shared["loads_without_hold"] == 0
    assert s_shared["saves_dropped"] == (1 if sync_load_mb is None else 0)

"""kvtier's KV events through real vLLM on CPU, received as a router receives them: a ZMQ
subscriber to vLLM's own KV-event publisher (``--kv-events-config``).

With vLLM's prefix cache on, vLLM publishes ``BlockStored`` for the blocks in its own cache
(medium GPU, whatever the device); kvtier publishes, through the same publisher, a
``BlockStored`` (medium CPU, ownership kvtier) for every chunk that lands in its host memory and
a ``BlockRemoved`` when host memory drops it. A router keys blocks by vLLM's block hashes, so
kvtier's events must carry exactly the hashes vLLM's own events give the same blocks.
"""

from __future__ import annotations

import socket

import pytest
from prompts import DOC, OTHER, gen

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# 2 KiB of KV per token (4 layers, 2 KV heads of 64, bf16): DOC stores ~1.3 MiB, OTHER ~1 MiB;
# a 1.6 MiB host tier holds either, not both.
CONFIG = {"tiers": ["local_cpu"], "local_cpu_size_gb": 1.6 / 1024}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvtier_events(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind and e["ownership"] == "kvtier"]


def test_block_stored_and_removed_carry_vllms_block_hashes(run_engine) -> None:
    steps = [gen(DOC), {"op": "kv_events"}, gen(OTHER), {"op": "kv_events"}]
    out = run_engine(
        {"kvtier": CONFIG, "prefix_caching": True, "kv_events_port": free_port(), "steps": steps}
    )
    first, second = out[1], out[3]
    vllm_hashes = {
        h
        for e in first
        if e["type"] == "BlockStored" and e["ownership"] is None
        for h in e["block_hashes"]
    }
    stored = kvtier_events(first, "BlockStored")
    # DOC's chunks [0,256) [256,512) and its tail blocks [512,672), one event each.
    assert [len(e["block_hashes"]) for e in stored] == [8, 8, 1, 1, 1, 1, 1]
    assert all(e["medium"] == "CPU" for e in stored)
    assert [t for e in stored for t in e["token_ids"]] == DOC[:672]
    ours = [h for e in stored for h in e["block_hashes"]]
    assert set(ours) <= vllm_hashes  # the hashes vLLM (and so a router) gives DOC's blocks
    # OTHER's chunks push DOC's out of the small host tier: each removal names hashes that
    # were announced as stored.
    removed = kvtier_events(second, "BlockRemoved")
    assert removed and all(e["medium"] == "CPU" for e in removed)
    assert {h for e in removed for h in e["block_hashes"]} <= set(ours)
    assert kvtier_events(second, "BlockStored")  # OTHER's own chunks

"""A disk directory that running engines share (``local_disk_shared``): an engine sees what
another wrote after it started, by probing; without the setting it answers from its own index of
the tier (what was there at its start, and what it wrote), which never sees the other's chunks.
Driven step by step against real worker parts (``sched_harness.py``); measured with two real
``vllm serve`` in ``kvtier bench node`` (docs/node-tier.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from sched_harness import BLOCK, CHUNK, Harness, request

DOC = list(range(2000, 2000 + 2 * CHUNK + BLOCK))
MOST = len(DOC) - BLOCK  # the last block holds the last prompt token: always recomputed


@pytest.mark.parametrize("shared", [False, True])
def test_a_chunk_another_running_engine_wrote_is_found_where_the_directory_is_shared(
    tmp_path, shared: bool
) -> None:
    disk = {"tiers": ["local_cpu", "local_disk"], "local_disk_path": str(tmp_path / "disk")}
    reader = Harness.create(save_unfull_chunk=True, local_disk_shared=shared, **disk)
    writer = Harness.create(save_unfull_chunk=True, **disk)  # another engine, started later
    try:
        writer.store(request(DOC))
        assert writer.ranks[0].engine.storage.flush(10.0)
        assert reader.hit(request(DOC)) == (MOST if shared else 0)
    finally:
        writer.close()
        reader.close()


def test_a_shared_directory_still_answers_what_this_engine_wrote(tmp_path) -> None:
    h = Harness.create(
        save_unfull_chunk=True,
        tiers=["local_cpu", "local_disk"],
        local_disk_path=str(tmp_path / "disk"),
        local_disk_shared=True,
    )
    try:
        h.store(request(DOC))
        assert h.hit(request(DOC)) == MOST
    finally:
        h.close()

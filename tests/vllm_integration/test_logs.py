"""kvtier's log lines inside vLLM: they are seen at the configured level, and at DEBUG each
request's path through the connector can be followed by its id."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the connector's scheduler half needs vLLM")

from sched_harness import BLOCK, CHUNK, Harness, request

from kvtier.vllm_integration import logs

DOC = list(range(1000, 1000 + 2 * CHUNK + BLOCK))


@contextlib.contextmanager
def bare_logging() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """The logging ``vllm serve`` leaves: no handler on the root logger or on ``kvtier``, one
    stream handler on ``vllm`` (here writing to a buffer); restored afterwards. (Entered in the
    test's body: pytest puts its own handlers on the root logger around the body.)"""
    root, kvtier, vllm = (logging.getLogger(n) for n in ("", "kvtier", "vllm"))
    saved = {lg: (lg.handlers[:], lg.level) for lg in (root, kvtier, vllm)}
    stream = io.StringIO()
    root.handlers.clear()
    kvtier.handlers.clear()
    vllm.handlers[:] = [logging.StreamHandler(stream)]
    try:
        yield kvtier, stream
    finally:
        for lg, (handlers, level) in saved.items():
            lg.handlers[:] = handlers
            lg.setLevel(level)


def test_lines_below_warning_reach_vllms_stream_at_the_configured_level() -> None:
    with bare_logging() as (kvtier, stream):
        logs.configure("info")
        logging.getLogger("kvtier.storage").info("an info line")
        logging.getLogger("kvtier").debug("a debug line")
        logs.configure("info")  # both connector halves in one process: still one handler
        assert len(kvtier.handlers) == 1
    out = stream.getvalue()
    assert "INFO" in out and "an info line" in out
    assert "a debug line" not in out
    assert out.count("an info line") == 1


def test_an_application_that_set_up_logging_is_left_alone() -> None:
    with bare_logging() as (kvtier, _):
        logging.getLogger().addHandler(logging.NullHandler())
        logs.configure("DEBUG")
        assert kvtier.handlers == [] and kvtier.level == logging.DEBUG


def test_at_debug_a_request_can_be_followed_by_its_id(caplog) -> None:
    h = Harness.create()
    try:
        with caplog.at_level(logging.DEBUG, logger="kvtier"):
            h.store(request(DOC))
            again = request(DOC)
            assert h.hit(again) == 2 * CHUNK
            again.num_computed_tokens = len(DOC)
            h.sched.request_finished(again, [])
    finally:
        h.close()
    mine = [r.getMessage() for r in caplog.records if again.request_id in r.getMessage()]
    assert any("goes to the workers" in m for m in mine), mine
    (answer,) = [m for m in mine if ": lookup:" in m]
    # The prompt's last block is always recomputed: two chunks of the three stored spans.
    assert f"{len(DOC)} prompt tokens, vLLM has 0, kvtier adds {2 * CHUNK} (probe" in answer
    assert f"local_cpu 0-{len(DOC)}" in answer  # where the probe found them, spans merged
    assert any(": finished: blocks freed now" in m for m in mine), mine

"""Shared test set-up. Fixture modules live in tests/fixtures/ (one per concern)."""

from __future__ import annotations

import os

import pytest

# Triton kernels run on CPU tensors through the interpreter when there is no GPU; it must be set
# before triton is first imported.
if os.environ.get("KVTIER_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest_plugins = [
    "fixtures.common",
    "fixtures.redis_server",
    "fixtures.node_dir",
    "fixtures.vllm_model",
    "fixtures.lora_adapter",
]

ENGINES = "tests/vllm_integration/"  # the tests that start vLLM engines, and vLLM's own unit tests
# Engine tests that need none of the session's engine runners (each starts its own process): the
# other worker takes them after its own tests, while the engines' worker is still busy.
SELF_CONTAINED = (ENGINES + "test_demo.py", ENGINES + "test_serve_metrics.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``pytest -n 2 --dist loadgroup`` (``python3 dev.py test``): every test under
    tests/vllm_integration that uses the session's engine runners goes to one worker, in order,
    so those engines never run two at a time (two streams of engines on 2 cores made tests time
    out) and the runner processes and models serve them all. The other worker runs the rest
    (storage, core, kernels under the interpreter), then the two engine tests that start a
    process of their own (the demo, ``vllm serve``): one engine beside the stream, not two
    streams. (By path, not by xdist's group marks: xdist 3.8 names a group in the test's node
    id, which pytest 9.2 no longer lets a plugin change.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EnginesApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(SELF_CONTAINED):
                return nodeid
            return ENGINES if nodeid.startswith(ENGINES) else nodeid

    return EnginesApart(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist's workers under ``--dist loadgroup``: the engines' tests first, since work is
    handed out in collection order and theirs is the long stream; the self-contained engine tests
    last, so that the other worker reaches them once its own tests are done."""
    if not getattr(config.option, "loadgroup", False):
        return

    def rank(item: pytest.Item) -> int:
        if item.nodeid.startswith(SELF_CONTAINED):
            return 2
        return 0 if item.nodeid.startswith(ENGINES) else 1

    items.sort(key=rank)  # stable: the order within each part is kept

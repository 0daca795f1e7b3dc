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
    "fixtures.vllm_model",
    "fixtures.lora_adapter",
]

ENGINES = "tests/vllm_integration/"  # the tests that start vLLM engines, and vLLM's own unit tests


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``pytest -n 2 --dist loadgroup`` (``python3 dev.py test``): every test under
    tests/vllm_integration goes to one worker, in order, so vLLM engines never run two at a time
    (on 2 cores one engine, its runner and the test process already fill them; two streams of
    engines made tests time out) and the session's runner processes and models serve them all;
    the other tests (storage, core, kernels under the interpreter) run on the other worker
    meanwhile. (By path, not by xdist's group marks: xdist 3.8 names a group in the test's
    node id, which pytest 9.2 no longer lets a plugin change.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EnginesApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ENGINES if nodeid.startswith(ENGINES) else nodeid

    return EnginesApart(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist's workers under ``--dist loadgroup``: the engines' tests first, since work is
    handed out in collection order and theirs is the long stream."""
    if not getattr(config.option, "loadgroup", False):
        return
    engines = [i for i in items if i.nodeid.startswith(ENGINES)]
    chosen = set(map(id, engines))
    items[:] = engines + [i for i in items if id(i) not in chosen]

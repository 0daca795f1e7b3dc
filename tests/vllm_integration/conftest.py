"""Fixtures of the vLLM end-to-end tests: the reference outputs and the partial-hit tolerance,
computed once per test session."""

from __future__ import annotations

import pytest
from prompts import DOC, OTHER, SHARED, gen, prefix_cache_tolerance


@pytest.fixture(scope="session")
def reference(run_engine) -> dict[str, dict]:
    """Greedy outputs and logprobs of vLLM without kvtier (prefix caching off)."""
    out = run_engine({"kvtier": None, "steps": [gen(DOC), gen(SHARED), gen(OTHER)]})
    return dict(zip(("doc", "shared", "other"), out, strict=True))


@pytest.fixture(scope="session")
def partial_tolerance(run_engine, reference) -> float:
    return prefix_cache_tolerance(run_engine, reference["shared"])

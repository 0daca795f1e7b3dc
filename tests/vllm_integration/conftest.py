"""Fixtures of the vLLM end-to-end tests: the reference outputs, computed once per test session
(``prompts.py`` says which result is compared with which)."""

from __future__ import annotations

import pytest
from prompts import DOC, OTHER, SHARED, gen, prefix_cache_hits


@pytest.fixture(scope="session")
def reference(run_engine) -> dict[str, dict]:
    """Greedy outputs and logprobs of vLLM without kvtier (prefix caching off): what a cold
    request must equal."""
    out = run_engine({"kvtier": None, "steps": [gen(DOC), gen(SHARED), gen(OTHER)]})
    return dict(zip(("doc", "shared", "other"), out, strict=True))


@pytest.fixture(scope="session")
def hit_reference(run_engine, reference) -> dict[str, dict]:
    """vLLM's own prefix cache on DOC's full hit (``doc``) and SHARED's partial hit (``shared``),
    in-process, no kvtier: what kvtier's hits on them must equal."""
    hits = prefix_cache_hits(run_engine)
    assert hits["cold"] == reference["doc"]  # a cold request is the same computation
    return hits

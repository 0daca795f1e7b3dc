"""Shared test set-up. Fixture modules live in tests/fixtures/ (one per concern)."""

from __future__ import annotations

import os

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

"""The long-document QA workload that ``kvtier demo`` and ``kvtier bench e2e`` run through vLLM.

Documents are synthetic text of a given token length (built from a seed); each gets questions
appended after it, so every question on a document shares the document's tokens as a prefix.
``Engine`` starts vLLM (with or without kvtier) and measures each request's time to first token
from vLLM's own per-request metrics.
"""

from __future__ import annotations

import os
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.model import synthetic_text

# vLLM's KV block size in the demo and the benches (vLLM CPU needs a multiple of 32).
BLOCK_SIZE = 32
# kvtier settings of the benches that time particular warm requests: none of them is sampled for
# verification (it would be computed instead of loaded); ``kvtier bench serve`` keeps the
# default and reports what verification cost.
BENCH_KVTIER: dict[str, Any] = {"verify_fraction": 0.0}

_TOPICS = (
    "the river system",
    "the national market",
    "the energy network",
    "the first season",
    "the village church",
    "the storage engine",
    "the county station",
    "the music album",
)


@dataclass(frozen=True)
class Request:
    doc: int
    question: int
    tokens: list[int]
    doc_tokens: int


def build_requests(
    tokenizer: Any, num_docs: int, doc_tokens: int, questions: int = 2, seed: int = 0
) -> list[list[Request]]:
    """``num_docs`` documents of exactly ``doc_tokens`` tokens, each with ``questions``
    questions."""
    rng = random.Random(seed)
    out = []
    for d in range(num_docs):
        text = synthetic_text(rng, doc_tokens * 2)
        doc = tokenizer(f"Document {d}.\n{text}", add_special_tokens=False).input_ids[:doc_tokens]
        reqs = []
        for q in range(questions):
            topic = _TOPICS[(d * questions + q) % len(_TOPICS)]
            ask = tokenizer(
                f"\nQuestion {q + 1}: what does the document say about {topic}?\nAnswer:",
                add_special_tokens=False,
            ).input_ids
            reqs.append(Request(d, q, doc + ask, len(doc)))
        out.append(reqs)
    return out


@dataclass
class Result:
    ttft_s: float
    tokens: list[int]
    text: str
    loaded_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens not computed: vLLM's prefix cache plus kvtier's hit


@dataclass
class Engine:
    """One vLLM engine (default multiprocess mode) with or without kvtier.

    ``kvtier``: None = no connector, else the ``kv_connector_extra_config`` dict.
    """

    model: str
    kvtier: dict[str, Any] | None = None
    prefix_caching: bool = False
    max_model_len: int = 4096
    kv_cache_bytes: int = 512 << 20
    dtype: str = "bfloat16"
    engine_id: str = field(default_factory=lambda: f"kvtier-{os.getpid()}-{time.monotonic_ns()}")

    def __post_init__(self) -> None:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from vllm import LLM

        kwargs: dict[str, Any] = {}
        if self.kvtier is not None:
            kwargs["kv_transfer_config"] = {
                "kv_connector": "KVTierConnector",
                "kv_role": "kv_both",
                "engine_id": self.engine_id,
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": self.kvtier,
            }
        self.llm = LLM(
            model=self.model,
            enforce_eager=True,
            block_size=BLOCK_SIZE,
            dtype=self.dtype,  # type: ignore[arg-type]
            kv_cache_memory_bytes=self.kv_cache_bytes,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.prefix_caching,
            disable_log_stats=False,
            seed=0,
            **kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()

    def metric(self, name: str, label: str | None = None) -> dict[str, float]:
        """A counter from vLLM's own metrics (what ``vllm serve`` exposes on ``/metrics``), summed
        by the value of ``label`` (``""`` when ``label`` is None)."""
        out: dict[str, float] = {}
        for m in self.llm.get_metrics():
            if m.name == name and hasattr(m, "value"):
                key = m.labels.get(label, "") if label else ""
                out[key] = out.get(key, 0.0) + float(m.value)
        return out

    def loaded_tokens(self) -> int:
        """Tokens kvtier loaded so far (``vllm:kvtier_loaded_tokens``)."""
        if self.kvtier is None:
            return 0
        return int(sum(self.metric("vllm:kvtier_loaded_tokens").values()))

    def hit_tokens_by_tier(self) -> dict[str, int]:
        """Tokens kvtier's lookups found so far, by tier (``vllm:kvtier_lookup_hit_tokens``)."""
        if self.kvtier is None:
            return {}
        by_tier = self.metric("vllm:kvtier_lookup_hit_tokens", "tier")
        return {tier: int(n) for tier, n in sorted(by_tier.items()) if n}

    def run(self, tokens: list[int], max_tokens: int) -> Result:
        from vllm import SamplingParams, TokensPrompt

        before = self.loaded_tokens()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        ttft = out.metrics.first_token_latency if out.metrics is not None else float("nan")
        comp = out.outputs[0]
        loaded = self.loaded_tokens() - before
        return Result(ttft, list(comp.token_ids), comp.text, loaded, out.num_cached_tokens or 0)

    def warm_up(self, num_tokens: int = 512) -> None:
        """The first requests of a process pay one-time kernel set-up (growing with the prompt
        length); keep it out of timings with two unrelated prompts of ``num_tokens``."""
        rng = random.Random(-1)
        for _ in range(2):
            self.run([rng.randrange(10, 2000) for _ in range(num_tokens)], 2)

    def flush(self) -> bool:
        if self.kvtier is None:
            return True
        from kvtier.vllm_integration.channel import flush_worker

        return flush_worker(self.engine_id)

    def zero_stored_kv(self, tokens: list[int]) -> int:
        """Overwrite every chunk kvtier stored for ``tokens`` with zeros, in the worker (after
        its pending saves landed): a later hit then loads wrong KV. The demo's negative
        control; the engine must have been started with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
        (a function is sent to the worker). Returns the chunks overwritten."""
        assert self.flush(), "kvtier's saves did not land"
        return sum(self.llm.collective_rpc(_zero_stored_kv, args=(tokens,)))

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


def zero_stored_states(tokens: list[int], salt: str | None = None) -> int:
    """In a vLLM process that runs kvtier's worker side for a Mamba hybrid: put zeros under
    every state entry kvtier stores for ``tokens`` (``kvtier.core.engine.states``), so a later hit
    loads a wrong recurrent state. Returns the entries overwritten."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    engine = get_kv_transfer_group().engine  # type: ignore[attr-defined]
    assert engine is not None and engine.states is not None, "not a Mamba hybrid's engine"
    prompt = engine.spans.prompt(tokens, salt)
    n = 0
    for i in range(len(prompt.full)):
        key = engine.states.key(prompt, (i + 1) * engine.chunk_size)
        if not engine.storage.contains([key])[0]:
            continue
        obj = engine.storage.allocate(engine.states.meta)
        assert obj is not None, "no host memory for the zeros"
        with obj:
            obj.tensor.zero_()
            engine.storage.put(key, obj)
        n += 1
    return n


def zero_stored_chunks(tokens: list[int], salt: str | None = None, group: int | None = None) -> int:
    """In a vLLM process that runs kvtier's worker side: put zeros under every key kvtier stores
    ``tokens`` under (its chunks and tail blocks, through the storage manager's public API), so
    a later hit loads wrong KV. The negative control of the demo and the end-to-end tests.
    ``group``: a hybrid model's KV cache group whose pages alone are zeroed (the others keep
    what was stored). Returns the chunks overwritten."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvtier.core.memory import MemoryObjMeta
    from kvtier.vllm_integration.connector import KVTierConnector

    connector = get_kv_transfer_group()
    assert isinstance(connector, KVTierConnector), "kvtier is not this engine's connector"
    engine = connector.engine
    assert engine is not None, "kvtier's worker side has no KV caches registered yet"
    lay = engine.layout
    n = 0
    for span in engine.store_spans(tokens, salt):
        meta = MemoryObjMeta(lay.chunk_shape(span.num_tokens), lay.chunk_dtype, span.num_tokens)
        obj = engine.storage.allocate(meta)
        assert obj is not None, "no host memory for the zeros"
        with obj:
            obj.tensor.zero_()
            if group is not None:
                stored = engine.storage.get(span.key)
                assert stored is not None, "the chunk to corrupt is not stored"
                with stored:
                    obj.tensor.copy_(stored.tensor)
                # Each block's rows hold every group's section in turn (KVLayout.group_rows).
                first = sum(lay.group_rows[:group])
                rows = obj.tensor.view(-1, lay.rows_per_block, *obj.tensor.shape[1:])
                rows[:, first : first + lay.group_rows[group]].zero_()
            engine.storage.put(span.key, obj)
        n += 1
    return n


def _zero_stored_kv(worker: Any, tokens: list[int]) -> int:
    """``zero_stored_chunks`` as a ``collective_rpc`` call (vLLM passes the worker first)."""
    return zero_stored_chunks(tokens)


def cpu_kind() -> str:
    """Which of the CPU kinds vLLM's CPU kernels tell apart this machine is: "AVX-512 + AMX"
    (vLLM picks its ``amx`` attention for bf16), "AVX-512", "AVX2 only" or "no AVX2"."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return "cpu flags unknown"
    if "avx512f" in flags:
        return "AVX-512 + AMX" if "amx_tile" in flags else "AVX-512"
    return "AVX2 only" if "avx2" in flags else "no AVX2"


def machine_name() -> str:
    """What a benchmark's JSON calls the machine: architecture, CPU count and ``cpu_kind``."""
    return f"{platform.machine()}, {os.cpu_count()} cpus, {cpu_kind()}"


def require_extras() -> None:
    """Fail before any work when what the demo/bench need is missing, naming what to install."""
    import importlib.util

    from kvtier.core.errors import MissingExtraError

    for module, what in (
        ("vllm", "vLLM"),
        ("rich", "rich (kvtier-vllm[demo])"),
        ("matplotlib", "matplotlib (kvtier-vllm[demo])"),
    ):
        if importlib.util.find_spec(module) is None:
            raise MissingExtraError(what, "vllm")


def results_dir(out: str | None) -> Path:
    path = Path(out) if out else Path("benchmarks") / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path

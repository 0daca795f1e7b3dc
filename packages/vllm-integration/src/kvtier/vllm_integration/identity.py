"""What makes two vLLM requests' KV the same: the engine's identity and each request's scope.

A chunk key must change whenever the KV would (``kvtier.core.keys``). From vLLM this takes:

- **The engine** (the key's model part): the model name or path, its revision, dtype,
  quantization, whether KV scales are computed at run time, and a digest of the model's whole
  HF config as vLLM loaded it (so ``hf_overrides``, rope scaling and any other override that
  changes the weights or positions change it). vLLM's KV cache dtype string (``fp8_e4m3`` and
  ``fp8_e5m2`` are both uint8 tensors) goes into the layout fingerprint instead.
- **The rank** (``engine_rank``): the engine-local tensor/pipeline-parallel rank, not the global
  torch rank (data-parallel engines of one model share chunks). MLA caches are the same on every
  tensor-parallel rank, so they are keyed by the pipeline rank alone and stored once.
- **The request** (``request_scope``): cache salt, LoRA adapter (name, path and a digest of its
  files) and the weights generation (bumped by ``reset_cache``) seed the hash chain.
- **Token ids** (``identity_tokens``): a multimodal item's placeholder tokens are the same for
  every image of one size, so they are replaced by ids derived from the item's content hash
  (vLLM's ``mm_features`` identifiers, the hashes its own prefix cache uses), position by
  position. The ids replaced are only hashed, never fed to the model.
- **Prompt embeddings** (``prompt_embeds``): their token ids are placeholders; such requests are
  neither looked up nor saved (``cacheable``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.keys import KeyScope

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

# Synthetic ids for multimodal placeholders live in [2**62, 2**63): far above any vocabulary,
# so they never equal a real token id.
_MM_ID_BASE = 1 << 62
_MM_ID_MASK = (1 << 62) - 1


def _digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def model_identity(vllm_config: VllmConfig) -> str:
    """The model part of every key: readable name, then a digest of everything that changes
    the weights or how positions are encoded."""
    mc = vllm_config.model_config
    try:
        hf = mc.hf_config.to_json_string(use_diff=False)
    except Exception:  # a config that cannot be serialised still has a stable repr
        hf = repr(sorted(vars(mc.hf_config).items()))
    fields = {
        "model": str(mc.model),
        "revision": str(getattr(mc, "revision", None)),
        "dtype": str(mc.dtype),
        "quantization": str(getattr(mc, "quantization", None)),
        "hf_overrides": repr(getattr(mc, "hf_overrides", None)),
        "calculate_kv_scales": str(getattr(vllm_config.cache_config, "calculate_kv_scales", None)),
        "hf_config": hf,
    }
    name = Path(str(mc.model).rstrip("/")).name or str(mc.model)
    return f"{name}-{_digest(json.dumps(fields, sort_keys=True))}"


def engine_rank(vllm_config: VllmConfig, use_mla: bool) -> tuple[int, int]:
    """``(world size, rank)`` for keys: the engine-local TP x PP position of this worker."""
    pc = vllm_config.parallel_config
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    tp_rank, pp_rank = 0, 0
    if tp * pp > 1:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank = int(get_tp_group().rank_in_group)
        pp_rank = int(get_pp_group().rank_in_group)
    if use_mla:
        return pp, pp_rank
    return tp * pp, pp_rank * tp + tp_rank


@lru_cache(maxsize=256)
def _adapter_digest(path: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.blake2b(digest_size=8)
    base = Path(path)
    for name, _, _ in stamp:
        h.update(name.encode() + b"\x00")
        with open(base / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def adapter_identity(lora_request: Any) -> str | None:
    """``name|path|digest of the adapter's files`` (digest cached by file names, sizes and
    modification times, so an adapter rewritten in place gets a new identity)."""
    if lora_request is None:
        return None
    name = str(getattr(lora_request, "lora_name", ""))
    path = str(getattr(lora_request, "lora_path", "") or "")
    digest = "-"
    if path and os.path.isdir(path):
        stamp = tuple(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(Path(path).iterdir())
            if p.is_file()
        )
        digest = _adapter_digest(path, stamp)
    return f"{name}|{path}|{digest}"


def request_scope(request: Request, generation: str | None) -> KeyScope:
    """The scope that seeds a request's hash chain."""
    return KeyScope(
        salt=request.cache_salt,
        adapter=adapter_identity(request.lora_request),
        generation=generation,
    )


def cacheable(request: Request) -> bool:
    """Prompt-embedding requests carry placeholder token ids: never looked up or saved."""
    return getattr(request, "prompt_embeds", None) is None


def _int64(tokens: list[int] | np.ndarray) -> np.ndarray:
    """A writable int64 copy of ``tokens``. A list goes through ``struct``, several times faster
    than numpy's element-by-element conversion (the scheduler converts every prompt once, in
    ``schedule()``); a float or an id outside int64 is a ``ValueError``."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64)
    try:
        packed = struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error as e:
        raise ValueError(f"token ids must be 64-bit integers: {e}") from None
    return np.frombuffer(bytearray(packed), dtype="<i8")


def identity_tokens(request: Request, tokens: list[int] | np.ndarray) -> np.ndarray:
    """``tokens`` (a prefix of the request's tokens, or all of them) as int64, with every
    multimodal placeholder position replaced by an id derived from its item's identifier."""
    out = _int64(tokens)
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        start, end = int(pos.offset), min(int(pos.offset) + int(pos.length), len(out))
        if start >= end:
            continue
        seed = int.from_bytes(
            hashlib.blake2b(str(feature.identifier).encode(), digest_size=8).digest(), "little"
        )
        offsets = np.arange(end - start, dtype=np.uint64)
        mixed = (np.uint64(seed) + offsets * np.uint64(0x9E3779B97F4A7C15)) & np.uint64(_MM_ID_MASK)
        out[start:end] = mixed.astype(np.int64) + _MM_ID_BASE
    return out

"""What makes two vLLM requests' KV the same: the engine's identity and each request's scope.

A chunk key must change whenever the KV would (``kvtier.core.keys``). From vLLM this takes:

- **The engine** (the key's model part): the served weights by their content (a digest of the
  checkpoint files vLLM loaded and of the live parameters, ``weights.py``), dtype,
  quantization, whether KV scales are computed at run time, and a digest of the model's whole
  HF config as vLLM loaded it (so ``hf_overrides``, rope scaling and any other override that
  changes how the weights are applied change it). Not the path, the mount point or a revision
  name: the same weights anywhere share, new weights at the old path never do. vLLM's KV cache
  dtype string (``fp8_e4m3`` and ``fp8_e5m2`` are both uint8 tensors) goes into the layout
  fingerprint.
- **The rank** (``engine_rank``): the engine-local tensor/pipeline-parallel rank, not the global
  torch rank (data-parallel engines of one model share chunks). MLA caches are the same on every
  tensor-parallel rank, so they are keyed by the pipeline rank alone and stored once.
- **The request** (``request_scope``): cache salt, LoRA adapter (a digest of its files'
  content) and the weights generation seed the hash chain. The generation is None until a
  ``reset_cache`` finds the live weights changed since start; it is then a digest of the live
  weights, the same on every instance that made the same change (``scheduler/generation.py``).
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.errors import ConfigError
from kvtier.core.keys import KeyScope
from kvtier.vllm_integration.weights import files_digest

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


# Serialisation details of the HF config that name where or how it was read, not the model.
_LOCATION_FIELDS = ("_name_or_path", "_commit_hash", "transformers_version")


def _hf_config_json(mc: Any) -> str:
    try:
        fields = json.loads(mc.hf_config.to_json_string(use_diff=False))
    except Exception:  # a config that cannot be serialised still has a stable repr
        fields = {k: repr(v) for k, v in vars(mc.hf_config).items()}
    for name in _LOCATION_FIELDS:
        fields.pop(name, None)
    return json.dumps(fields, sort_keys=True, default=repr)


def model_identity(vllm_config: VllmConfig, weights: str) -> str:
    """The model part of every key: the model type (readable), then a digest of the served
    weights' content (``weights``, from ``kvtier.vllm_integration.weights``) and of everything
    that changes how they are applied. Never the path, the mount point or a revision name."""
    mc = vllm_config.model_config
    fields = {
        "weights": weights,
        "dtype": str(mc.dtype),
        "quantization": str(getattr(mc, "quantization", None)),
        "hf_overrides": repr(getattr(mc, "hf_overrides", None)),
        "calculate_kv_scales": str(getattr(vllm_config.cache_config, "calculate_kv_scales", None)),
        "hf_config": _hf_config_json(mc),
    }
    label = str(getattr(mc.hf_config, "model_type", "") or "model")
    label = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
    return f"{label}-{_digest(json.dumps(fields, sort_keys=True))}"


def engine_weights(vllm_config: VllmConfig, digest: str) -> str:
    """The engine's weights digest from this worker's (``digest`` of its shard): every
    tensor-parallel and pipeline-parallel rank's, gathered (all workers call this together, in
    ``register_kv_caches``), so all of them key chunks under one model part."""
    pc = vllm_config.parallel_config
    if int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size) == 1:
        return digest
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    from kvtier.vllm_integration.weights import combine

    for group in (get_tp_group(), get_pp_group()):
        if group.world_size == 1:
            continue
        gathered: list[Any] = [None] * group.world_size
        dist.all_gather_object(gathered, digest, group=group.cpu_group)
        digest = combine(dict(enumerate(str(d) for d in gathered)))
    return digest


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


def _adapter_dir(path: str) -> str | None:
    """The local directory of an adapter given as a directory or a Hub id already downloaded
    (vLLM's workers download Hub adapters into the Hugging Face cache); None when unknown."""
    if path and os.path.isdir(path):
        return path
    if not path:
        return None
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id=path, local_files_only=True)
    except Exception:  # not a Hub id, or not downloaded yet
        return None
    return str(local) if os.path.isdir(local) else None


_UNRESOLVED = "unresolved:"


def adapter_identity(lora_request: Any) -> str | None:
    """A LoRA adapter by its content: a digest of its files (``weights.files_digest``, as for a
    checkpoint: remembered per file version, so an adapter rewritten in place gets a new
    identity), wherever they live and whatever the adapter is called. An adapter whose files
    cannot be read here gets an ``unresolved:`` identity, and its requests are neither looked up
    nor saved (``keyable``). None: no adapter."""
    if lora_request is None:
        return None
    name = str(getattr(lora_request, "lora_name", ""))
    path = str(getattr(lora_request, "lora_path", "") or "")
    local = _adapter_dir(path)
    if local is None:
        return f"{_UNRESOLVED}{name}|{path}"
    return f"lora:{files_digest([p for p in Path(local).iterdir() if p.is_file()])}"


def request_scope(request: Request, generation: str | None) -> KeyScope:
    """The scope that seeds a request's hash chain."""
    return KeyScope(
        salt=request.cache_salt,
        adapter=adapter_identity(request.lora_request),
        generation=generation,
    )


def keyable(request: Request, adapter: str | None) -> bool:
    """Whether ``request``, whose adapter identity is ``adapter``, can be keyed: prompt-embedding
    requests carry placeholder token ids, and an adapter whose files cannot be read has no
    content identity; such requests are never looked up or saved."""
    if getattr(request, "prompt_embeds", None) is not None:
        return False
    return adapter is None or not adapter.startswith(_UNRESOLVED)


def cacheable(request: Request) -> bool:
    """``keyable`` for a request whose adapter identity is not known yet."""
    return keyable(request, adapter_identity(getattr(request, "lora_request", None)))


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


def refuse_context_parallel(parallel_config: Any) -> None:
    """Context parallelism shards a request's tokens over ranks (vLLM's scheduler block is then
    ``block_size x dcp``, each rank holding a slice of every block): kvtier maps slots with the
    plain block size and MLA keys drop the tensor-parallel rank, so every rank's shard would be
    stored under one key. Refused at start with a named error until each shard is keyed by its
    own rank and slots follow vLLM's scheduler block."""
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel_config, name, 1) or 1)
        if size > 1:
            raise ConfigError(
                name, size, "kvtier does not support context parallelism yet (set it to 1)"
            )

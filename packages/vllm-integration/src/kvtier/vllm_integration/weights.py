"""The weights an engine serves, by their content: the model part of every key.

A key must change whenever the KV would, and be the same wherever the same weights are served.
A path, a mount point or a Hub revision name says neither (a checkpoint replaced in place keeps
its path; the same files mounted elsewhere change it). So a worker names its weights by two
digests (``served_weights``), taken in ``register_kv_caches``:

- **the checkpoint files** vLLM loaded, every byte (``files_digest``; 64 MiB pieces hashed on
  every core, remembered per file version so a restart does not read them again). This covers
  what the live parameters cannot show: vLLM CPU repacks linear layers into its kernels' own
  buffers and empties their parameters.
- **the live parameters** (``model_digest``): each parameter's name, dtype, shape, a 64-bit
  wrapping sum of its memory read as integer words (exact, so the same on every device and in
  any reduction order; it runs at memory speed) and ``SAMPLES`` evenly spaced elements. This is
  what ``reset_cache`` takes again to see whether the weights were changed in place (an RL
  update through ``collective_rpc``). A change that keeps a tensor's word sum and every sampled
  element is not seen; no training update is such a change.

A tensor-parallel or pipeline-parallel engine's workers each digest their own shard; the
engine's identity combines every rank's digest (``combine``), so the key's model part is the same
on all of its workers and on every engine with the same weights and the same parallel layout.
docs/keys-and-tiers.md has what is in the identity and what the digests cost.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvtier.core.config import default_cache_dir
from kvtier.core.errors import LayoutError

# What vLLM's loaders read, by preference: safetensors when the checkpoint has them.
WEIGHT_PATTERNS = (("*.safetensors",), ("*.bin", "*.pt", "*.pth"), ("*.gguf",))
SEGMENT = 64 << 20  # bytes of a file hashed as one piece (pieces are hashed in parallel)
SAMPLES = 1024  # elements sampled from every parameter, evenly spaced (both ends included)
_FRAMES = 24  # how far up the stack ``find_model`` looks for vLLM's model runner


def _word_sum(flat: torch.Tensor) -> torch.Tensor:
    """The wrapping 64-bit sum of ``flat``'s memory read as the widest integer words that tile
    it (int64 words sum at memory speed; narrower ones are widened as they are added). Integer
    addition modulo 2**64 is exact in any order, so every device and reduction agrees."""
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    n = raw.numel()
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if n % size == 0:
            try:
                words = raw.view(dtype)
            except RuntimeError:  # a storage offset not aligned to the word
                continue
            return words.sum() if dtype == torch.int64 else words.sum(dtype=torch.int64)
    return raw.sum(dtype=torch.int64)


def _tensor_part(name: str, t: torch.Tensor) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    """``(name, dtype and shape; the word sum (device scalar); the samples as bytes (device))``."""
    flat = t.detach().reshape(-1)
    header = f"{name}\x00{t.dtype}\x00{tuple(t.shape)}\x00".encode()
    if flat.numel() == 0:
        empty = torch.zeros(0, dtype=torch.uint8, device=t.device)
        return header, torch.zeros((), dtype=torch.int64, device=t.device), empty
    total = _word_sum(flat)
    n = flat.numel()
    k = min(SAMPLES, n)
    # Integer arithmetic: a float linspace rounds past the end above 2**24 elements.
    idx = torch.arange(k, device=t.device, dtype=torch.int64) * (n - 1) // max(1, k - 1)
    picked = flat[idx].contiguous()
    sample = picked.view(torch.uint8) if picked.dtype != torch.bool else picked.to(torch.uint8)
    return header, total, sample.reshape(-1)


def digest_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A hex digest of ``named`` tensors' content (see the module docstring), in name order.
    The tensors' sums and samples are gathered on their devices and copied once per device."""
    parts = sorted(named, key=lambda item: item[0])
    h = hashlib.blake2b(b"kvtier-weights-v1", digest_size=16)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    headers: list[bytes] = []
    for i, (name, t) in enumerate(parts):
        header, total, sample = _tensor_part(name, t)
        headers.append(header)
        by_device.setdefault(t.device, []).append((i, total, sample))
    sums: dict[int, int] = {}
    samples: dict[int, bytes] = {}
    for entries in by_device.values():
        totals = torch.stack([total for _, total, _ in entries]).cpu().tolist()
        lengths = [int(s.numel()) for _, _, s in entries]
        blob = torch.cat([s for _, _, s in entries]).cpu().numpy().tobytes()
        offset = 0
        for (i, _, _), total, length in zip(entries, totals, lengths, strict=True):
            sums[i] = int(total)
            samples[i] = blob[offset : offset + length]
            offset += length
    for i, header in enumerate(headers):
        h.update(len(header).to_bytes(8, "little") + header)
        h.update(sums[i].to_bytes(8, "little", signed=True))
        h.update(len(samples[i]).to_bytes(8, "little") + samples[i])
    return h.hexdigest()


def model_digest(model: torch.nn.Module) -> str:
    """The digest of ``model``'s parameters (buffers are derived state: rotary tables, scales
    computed at run time)."""
    named = list(model.named_parameters(remove_duplicate=True))
    if not named:
        raise LayoutError("the model has no parameters: kvtier cannot name its weights")
    return digest_tensors(named)


def combine(rank_digests: dict[int, str]) -> str:
    """An engine's weights digest from every worker's (rank -> digest of its shard)."""
    if len(rank_digests) == 1:
        return next(iter(rank_digests.values()))
    h = hashlib.blake2b(b"kvtier-ranks-v1", digest_size=16)
    for rank in sorted(rank_digests):
        h.update(rank.to_bytes(4, "little") + rank_digests[rank].encode())
    return h.hexdigest()


def find_model(max_frames: int = _FRAMES) -> torch.nn.Module:
    """The model vLLM's model runner serves, from the caller's stack.

    vLLM 0.32 hands a connector its KV tensors (``register_kv_caches``) but not the model; the
    model runner that calls it (V1's ``GPUModelRunner`` and its CPU subclass, Model Runner V2
    through its connector wrapper) holds it, and its ``get_model()`` returns it. Raises
    ``LayoutError`` when no caller has one: kvtier never keys chunks without knowing the weights.
    """
    frame: Any = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        getter = getattr(owner, "get_model", None)
        if callable(getter):
            try:
                model = getter()
            except Exception:  # a runner whose model is not loaded yet
                model = None
            if isinstance(model, torch.nn.Module):
                return model
        frame = frame.f_back
    raise LayoutError(
        "kvtier could not find the model among register_kv_caches' callers (a vLLM model runner "
        "with get_model()): its keys name the weights by their content, so it cannot start "
        "without them"
    )


def weight_files(model: str, revision: str | None = None) -> list[Path]:
    """The checkpoint files vLLM loads for ``model`` (a directory, a single file, or a Hub id
    already in the local Hugging Face cache); empty when none can be found here."""
    path = Path(model)
    if path.is_file():
        return [path]
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(repo_id=model, revision=revision, local_files_only=True))
        except Exception:  # not a Hub id, or not in the local cache
            return []
    for patterns in WEIGHT_PATTERNS:
        found = sorted({f for pattern in patterns for f in path.glob(pattern) if f.is_file()})
        if found:
            return found
    return []


def _segment_digest(path: Path, offset: int, length: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            block = f.read(min(left, 8 << 20))
            if not block:
                raise LayoutError(f"weight file {path} shrank while kvtier read it")
            h.update(block)
            left -= len(block)
    return h.digest()


def _file_stamp(path: Path) -> str:
    """What identifies one version of a file here: any write changes its ctime."""
    st = path.stat()
    parts = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


# File version stamp -> digest, for this process (adapters are asked for at every lookup).
_DIGESTS: dict[str, str] = {}


def file_digest(path: Path, workers: int | None = None) -> str:
    """A hex digest of ``path``'s whole content (64 MiB pieces hashed in parallel, then their
    digests), remembered per file version under the kvtier cache directory so a restart reads
    the file once more only if it changed (new inode, size, mtime or ctime)."""
    stamp = _file_stamp(path)
    if stamp in _DIGESTS:
        return _DIGESTS[stamp]
    cached = Path(default_cache_dir()) / "weights" / f"{stamp}.json"
    try:
        digest = str(json.loads(cached.read_text())["digest"])
        _DIGESTS[stamp] = digest
        return digest
    except (OSError, ValueError, KeyError, TypeError):
        pass
    size = path.stat().st_size
    pieces = [(off, min(SEGMENT, size - off)) for off in range(0, size, SEGMENT)] or [(0, 0)]
    n = workers or min(len(pieces), os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, n)) as pool:
        digests = list(pool.map(lambda p: _segment_digest(path, *p), pieces))
    h = hashlib.blake2b(b"kvtier-file-v1", digest_size=16)
    h.update(size.to_bytes(8, "little"))
    for d in digests:
        h.update(d)
    digest = h.hexdigest()
    if _file_stamp(path) == stamp:  # not written while it was read
        _DIGESTS[stamp] = digest
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"digest": digest, "file": str(path)}))
            os.replace(tmp, cached)
        except OSError:
            pass  # an unwritable cache only costs the next start a read
    return digest


def files_digest(files: list[Path]) -> str:
    """The checkpoint's digest: every file's content, in name order (names relative to their
    directory, so the same checkpoint anywhere has the same digest)."""
    h = hashlib.blake2b(b"kvtier-checkpoint-v1", digest_size=16)
    for f in sorted(files, key=lambda p: p.name):
        h.update(f.name.encode() + b"\x00" + file_digest(f).encode())
    return h.hexdigest()


def served_weights(vllm_config: Any) -> tuple[torch.nn.Module, str, str]:
    """``(model, weights, live)`` for the worker this is called in (from vLLM's
    ``register_kv_caches``): ``weights`` digests the checkpoint files vLLM loaded, every byte,
    and the live parameters (``model_digest``: what process_weights_after_loading kept; vLLM CPU
    repacks linear layers into kernels' own buffers and may empty their parameters, so the files
    are what covers those); ``live`` is the live parameters' digest alone, what ``reset_cache``
    compares to see whether the weights changed in place."""
    mc = vllm_config.model_config
    model = find_model()
    live = model_digest(model)
    files = weight_files(str(mc.model), getattr(mc, "revision", None))
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    if files:
        checkpoint = files_digest(files)
    elif load_format == "dummy":
        # Random weights from vLLM's seeded initialiser: what the live parameters show is all.
        checkpoint = f"dummy-seed-{getattr(mc, 'seed', None)}"
    else:
        raise LayoutError(
            f"kvtier cannot find the weight files vLLM loaded for {mc.model!r} (load_format "
            f"{load_format!r}): its keys name the weights by their content"
        )
    h = hashlib.blake2b(b"kvtier-served-v1", digest_size=16)
    h.update(checkpoint.encode() + b"\x00" + live.encode())
    return model, h.hexdigest(), live

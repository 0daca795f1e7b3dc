"""How stored KV is compared with KV the engine recomputed (``kvtier.core.verify``).

A page (one layer's one block) is read as the cache's element type and its error is
``mean |stored - fresh| / mean |fresh|`` (``page_errors``).

A recurrent-state entry (``kvtier.core.engine.states``) is compared the same way, part by part
(``state_error``). A Mamba / linear-attention layer keeps its states packed one after another
from the first byte of its block's page, each of its own shape and element type (vLLM's
``MambaBase.bind_kv_cache``: e.g. a convolution state in the model's dtype, then an SSM state in
fp32). The group's kind names them in that order (``MambaSpec/<type>/<shape>:<dtype>,...``,
recorded in ``KVLayout.states``). The tolerance is the cache's (the model's dtype): a state
computed from the same prompt in another batch shape inherits the rounding of the layers before
it, whatever its own element type; a state of another prompt, or zeros, differs by the size of
the values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import dtype_from_name


def page_errors(fresh: torch.Tensor, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[blocks, layers]`` errors of two chunks' pages (``[blocks, layers, page_bytes]`` uint8,
    same shape): ``mean |stored - fresh| / mean |fresh|`` per page; a page of NaNs or infinities
    (bytes that are not KV) is an infinite error, two all-zero pages none."""
    blocks, layers, _ = fresh.shape
    f = fresh.contiguous().view(dtype).to(torch.float32).reshape(blocks, layers, -1)
    s = stored.contiguous().view(dtype).to(torch.float32).reshape(blocks, layers, -1)
    diff = (s - f).abs().mean(-1)
    scale = f.abs().mean(-1)
    err = torch.where(diff == 0, torch.zeros_like(diff), diff / scale.clamp_min(1e-30))
    return torch.nan_to_num(err, nan=float("inf"))


# A state group's tensors in its page, in order: (bytes, element type).
Parts = tuple[tuple[int, torch.dtype], ...]


def state_parts(kind: str) -> Parts | None:
    """The tensors a state group's page holds, from its kind; None when the kind does not name
    them (another writer's kind, an element type kvtier does not read): not compared."""
    name, _, rest = kind.partition("/")
    _, _, listed = rest.partition("/")
    if name != "MambaSpec" or not listed:
        return None
    out = []
    for part in listed.split(","):
        shape, _, dtype = part.rpartition(":")
        try:
            dims = [int(d) for d in shape.split("x")] if shape else []
            dt = dtype_from_name(dtype)
        except (ValueError, LayoutError):
            return None
        out.append((math.prod(dims) * dt.itemsize, dt))
    return tuple(out)


@dataclass(frozen=True)
class StateError:
    """The worst part of a state entry against the recomputed state."""

    error: float
    group: int  # the state group (index into ``KVLayout.states``)
    layer: int
    part: int  # the tensor's index in the group's page


def state_error(fresh: torch.Tensor, stored: torch.Tensor, parts: Sequence[Parts]) -> StateError:
    """The worst part error of ``stored`` against ``fresh`` (``[groups, layers, page_bytes]``
    uint8, ``parts[g]`` the tensors of group ``g``): NaNs and infinities are an infinite error,
    two all-zero parts none."""
    worst = StateError(0.0, 0, 0, 0)
    for g, group in enumerate(parts):
        offset = 0
        for i, (nbytes, dtype) in enumerate(group):
            sl = slice(offset, offset + nbytes)
            err = page_errors(fresh[g : g + 1, :, sl], stored[g : g + 1, :, sl], dtype)[0]
            layer = int(torch.argmax(err))
            if float(err[layer]) > worst.error:
                worst = StateError(float(err[layer]), g, layer, i)
            offset += nbytes
    return worst

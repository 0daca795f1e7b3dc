"""Where kvtier's log lines go inside vLLM, and the per-request trace at DEBUG.

vLLM configures only its own ``vllm`` logger; the root logger has no handler in ``vllm serve``,
so Python would print kvtier's warnings bare and drop everything below WARNING, whatever
``log_level`` says. ``configure`` gives the ``kvtier`` logger a handler on vLLM's stream, in a
format like vLLM's, unless the application has set up logging itself (a handler on ``kvtier``
or on the root logger), which is then left alone.

With ``log_level: DEBUG`` each request's path through kvtier is logged, one line per decision,
each starting ``kvtier: request <id>:`` (grep a request id to follow it): the lookup's answer
(tokens vLLM has, tokens kvtier adds, where they come from), a probe sent, the request's end (its
blocks freed at once, held for its saves, or remembered for a lazy save) and, on the worker,
what each load filled.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.vllm_integration.scheduler.prompts import Probe

LOGGER = "kvtier"
logger = logging.getLogger(LOGGER)
_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


def configure(level: str) -> None:
    """Set the ``kvtier`` logger's level and make sure its lines are seen (module docstring)."""
    logger.setLevel(level.upper())
    if logger.handlers or logging.getLogger().handlers:
        return
    vllm = [h for h in logging.getLogger("vllm").handlers if isinstance(h, logging.StreamHandler)]
    handler = logging.StreamHandler(vllm[0].stream if vllm else sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, "%m-%d %H:%M:%S"))
    logger.addHandler(handler)


def lookup(
    req_id: str, prompt: int, computed: int, new: int, probe: Probe, load_async: bool
) -> None:
    """A lookup's answer to vLLM."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    # hold -1: the index answered (a hit it knows, or a miss it rules out); no probe went out
    how = "index" if probe.hold_id < 0 else "probe timed out" if probe.expired else "probe"
    merged: list[list[Any]] = []
    for start, end, tier in probe.sources:
        if merged and merged[-1][2] == tier and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end, tier])
    where = ", ".join(f"{tier or '?'} {start}-{end}" for start, end, tier in merged)
    logger.debug(
        "kvtier: request %s: lookup: %d prompt tokens, vLLM has %d, kvtier adds %d (%s%s)%s",
        req_id,
        prompt,
        computed,
        new,
        how,
        f"; {where}" if where and new else "",
        ", loaded on the worker's thread" if load_async else "",
        stacklevel=2,
    )


def finished(req_id: str, what: str) -> None:
    """A request's end, and what happens to its blocks."""
    logger.debug("kvtier: request %s: finished: %s", req_id, what, stacklevel=2)


def verify_sampled(req_id: str, computed: int, hit: int) -> None:
    logger.debug(
        "kvtier: request %s: sampled for verification: vLLM computes tokens %d-%d itself "
        "(kvtier holds them), then they are compared with the stored chunks",
        req_id,
        computed,
        hit,
    )


SLEEP_MODE_REASON = (
    "kvtier does not support vLLM's sleep mode: sleep releases the KV cache memory that "
    "kvtier's saver, loader and probe threads read, and draining them before it goes and "
    "registering the new views on wake (unregister_kv_caches / restore_kv_caches) is not "
    "built; serve without --enable-sleep-mode, or without kvtier"
)


def sleep_mode_refused() -> None:
    """vLLM asked whether kvtier supports sleep mode (it refuses to start with both)."""
    logger.warning("kvtier: %s", SLEEP_MODE_REASON)

"""Prefill/decode disaggregation through the shared tiers (vLLM's ``kv_role``).

A ``kv_producer`` (prefill instance) saves and never loads; when a request finishes it announces
what its engine stores in the request's ``kv_transfer_params``
(``{"kvtier": {"stored_tokens": n, "receipt": "<hex>"}}``), which vLLM returns with the
response: a proxy (``kvtier bench pd``'s, or vLLM's disaggregated serving proxy pattern) sends
the decode request on with them. Its lower-tier writes wait for room in a full write queue
instead of being dropped (``write_queue_wait_s``; the wait is the chunk's, in the queue, never
the saver thread's). The announcement is made when the request finishes, before its saves are
done, and a store can still be skipped after it (host memory full of chunks still being
written, a write whose wait ran out, a failed tier): so after the request's last save each rank
writes a receipt (``kvtier.core.keys.receipts``) that reaches the shared tiers after every chunk put
before it.

A ``kv_consumer`` (decode instance) loads and never saves. A request that arrives with a
producer's announcement may get there before the producer's chunks are readable in the shared
tier (its writes to Redis are asynchronous): its lookup is answered "not yet" and probed again,
every ``REPROBE_S``, until every announced token is found, or every rank found the receipt
before the chunks (what is there is all that is coming), or ``consumer_wait_s`` has passed (a
producer that died, or wrote no receipt); then it is served with what is there. The scheduler
never blocks meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys.receipts import receipt_id
from kvtier.vllm_integration.messages import ReceiptSpec

logger = logging.getLogger("kvtier")

KEY = "kvtier"
REPROBE_S = 0.05  # a waiting consumer request's lookups go to the workers at most this often
PRODUCER_WRITE_WAIT_S = 10.0  # at least, for a producer (``write_queue_wait_s``)


ROLES = ("kv_both", "kv_producer", "kv_consumer")


def check_role(config: KVTierConfig, role: str) -> None:
    """vLLM's ``kv_role`` with kvtier's config: a known role, and a producer saving eagerly."""
    if role not in ROLES:
        raise ConfigError("kv_role", role, f"must be one of {', '.join(ROLES)}")
    if config.offload == "lazy" and role == "kv_producer":
        raise ConfigError(
            "offload",
            config.offload,
            "a kv_producer's chunks are another instance's input: they must be saved as they "
            "are computed (offload=eager)",
        )


def announcement(stored_tokens: int, receipt: bytes | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` a producer returns for a request whose first
    ``stored_tokens`` tokens it saved, and whose saves end with ``receipt``."""
    mine: dict[str, Any] = {"stored_tokens": stored_tokens}
    if receipt is not None:
        mine["receipt"] = receipt.hex()
    return {KEY: mine}


def producer_params(
    saved_upto: int, prompt_len: int, step: int, receipt: bytes | None = None
) -> dict[str, Any] | None:
    """A producer's ``kv_transfer_params`` for a request that handed tokens ``[0, saved_upto)``
    to its saves, which store whole units of ``step`` tokens (blocks with ``save_unfull_chunk``,
    else chunks): what the engine stores, not what it was handed, so a consumer never waits for
    a tail that is not coming (None when not one unit of the prompt was stored); with the
    receipt its workers write after those saves, if one was sent."""
    stored = min(saved_upto, prompt_len)
    return announcement(stored - stored % step, receipt) if stored >= step else None


class Receipts:
    """A producer's receipts: one per request, sent to the workers with the step in which the
    request's prompt was handed to its saves (after them, on the same saver thread)."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.sent: dict[str, bytes] = {}  # request id -> its receipt, until it finishes

    def due(self, rid: str, prompt_saved: bool, scope: Any) -> ReceiptSpec | None:
        """The receipt to send with this step's saves: once the prompt was handed to them."""
        if not prompt_saved or rid in self.sent:
            return None
        receipt = self.sent[rid] = receipt_id(self.engine_id, rid)
        return ReceiptSpec(rid, receipt, scope)

    def preempted(self, rid: str) -> None:
        """Its KV is saved again on resume: a new receipt after those saves."""
        self.sent.pop(rid, None)

    def finished(self, rid: str) -> bytes | None:
        return self.sent.pop(rid, None)


def producer_config(config: KVTierConfig) -> KVTierConfig:
    """A producer's writes to the shared tiers wait for room rather than being dropped."""
    if config.write_queue_wait_s >= PRODUCER_WRITE_WAIT_S:
        return config
    return config.replace(write_queue_wait_s=PRODUCER_WRITE_WAIT_S)


def announced(params: dict[str, Any] | None) -> int:
    """Tokens a producer announced in ``params`` (0: none, or not a kvtier announcement)."""
    mine = (params or {}).get(KEY)
    if not isinstance(mine, dict):
        return 0
    n = mine.get("stored_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def announced_receipt(params: dict[str, Any] | None) -> bytes | None:
    """The receipt a producer announced in ``params`` (None: none, or not one)."""
    mine = (params or {}).get(KEY)
    text = mine.get("receipt") if isinstance(mine, dict) else None
    if not isinstance(text, str) or len(text) != 32:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


class ConsumerWait:
    """The deadlines of consumer requests waiting for announced chunks."""

    def __init__(self, config: KVTierConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.wait_s = config.consumer_wait_s
        self._clock = clock
        self._since: dict[str, float] = {}  # request id -> when it started waiting
        self._next: dict[str, float] = {}  # request id -> when it may be probed again
        self.timeouts = 0
        self.settled_short = 0  # waits ended by the producer's receipt, fewer tokens found

    def keep_waiting(self, rid: str, found: int, expected: int, settled: bool = False) -> bool:
        """Whether a request whose lookup found ``found`` of ``expected`` announced tokens
        waits on (never once ``settled``: every rank found the producer's receipt before the
        chunks); logs once when its wait ends short."""
        if found >= expected:
            self.done(rid)
            return False
        if settled:
            self.settled_short += 1
            logger.info(
                "kvtier: request %s: its producer stored %d of the %d tokens it announced "
                "(its receipt is written); the rest is computed here",
                rid,
                found,
                expected,
            )
            self.done(rid)
            return False
        now = self._clock()
        since = self._since.setdefault(rid, now)
        if now - since < self.wait_s:
            return True
        self.timeouts += 1
        logger.warning(
            "kvtier: request %s: %d of the %d tokens its producer announced were readable "
            "after %.1f s (consumer_wait_s); the rest is computed here",
            rid,
            found,
            expected,
            now - since,
        )
        self.done(rid)
        return False

    def may_probe(self, rid: str) -> bool:
        """Whether a waiting request's lookup may go to the workers again now (paced)."""
        now = self._clock()
        if now < self._next.get(rid, 0.0):
            return False
        self._next[rid] = now + REPROBE_S
        return True

    def done(self, rid: str) -> None:
        self._since.pop(rid, None)
        self._next.pop(rid, None)

"""Hand-over receipts: a kv_producer's word that its writes for one request are over.

A producer announces a request's tokens when the request finishes (vLLM returns the request's
``kv_transfer_params`` then), before its saves and their lower-tier writes are done, and a store
can still be skipped after that: host memory full of chunks still being written, a write queue
whose wait ran out, a tier that failed. So after the request's last save each of the producer's
ranks writes a *receipt*: a small record under a key named by the producer's engine and the
request, put with ``StorageManager.put_last``, so that it reaches each lower tier only after
every chunk put before it landed there or was dropped. A consumer that finds the receipt, and
then looks at the chunks, finds all that is coming: it stops waiting (``handover.py``).

A receipt is stored as an alias entry (``kvtier.core.keys.aliases``: a small record kept, sealed,
checksummed, evicted and namespaced like a chunk by every tier, with no code of its own) whose
target is the zero hash. Its own hash is a digest of the engine and request ids under a
personalization of its own, so no prompt's tail hash is ever one; only its presence is asked.
A receipt that cannot be written (host memory without room even for it) leaves the consumer
its bounded wait (``consumer_wait_s``), as before receipts.
"""

from __future__ import annotations

import hashlib

from kvtier.core.keys import KeyFactory, Scope
from kvtier.core.keys.aliases import Alias, encode_alias
from kvtier.core.storage import StorageManager

_PERSON = b"kvtier-receipt"
_NO_TARGET = bytes(16)


def receipt_id(engine_id: str, req_id: str) -> bytes:
    """The receipt of request ``req_id`` of the engine ``engine_id`` (16 bytes)."""
    engine = engine_id.encode()
    data = len(engine).to_bytes(8, "little") + engine + req_id.encode()
    return hashlib.blake2b(data, digest_size=16, person=_PERSON).digest()


def write_receipt(
    storage: StorageManager, keys: KeyFactory, receipt: bytes, scope: Scope = None
) -> bool:
    """Put ``receipt`` after every chunk put before it; False when host memory had no room."""
    obj = encode_alias(Alias(receipt, _NO_TARGET, 1), storage.allocate)
    if obj is None:
        return False
    try:
        storage.put_last(keys.alias_key(receipt, scope), obj)
    finally:
        obj.release()
    return True


def has_receipt(
    storage: StorageManager, keys: KeyFactory, receipt: bytes, scope: Scope = None
) -> bool:
    """Whether some tier holds ``receipt``."""
    return storage.contains([keys.alias_key(receipt, scope)])[0]

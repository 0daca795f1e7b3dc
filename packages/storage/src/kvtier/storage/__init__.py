"""kvtier-storage: the tiered StorageManager and its backends (host memory, local disk, Redis).

The redis backend and the CLI's Redis inventory speak RESP with kvtier's own client
(``backends/redis/resp.py``): no Redis client library is needed. ``encryption_key`` needs the
``encryption`` extra (``MissingExtraError`` names it when it is missing).
"""

from kvtier.storage.__about__ import __version__
from kvtier.storage.backends.base import BackendContext, StorageBackend
from kvtier.storage.manager import TieredStorageManager, tiered_storage_manager
from kvtier.storage.stats import StorageStats

__all__ = [
    "BackendContext",
    "StorageBackend",
    "StorageStats",
    "TieredStorageManager",
    "__version__",
    "tiered_storage_manager",
]

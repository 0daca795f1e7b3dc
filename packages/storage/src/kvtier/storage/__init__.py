"""kvtier-storage: the tiered StorageManager and its backends (host memory, local disk, Redis).

Importing this package never imports redis-py; the redis backend imports it when selected and
raises ``MissingExtraError`` (naming the ``redis`` extra) when it is not installed.
"""

from kvtier.storage.__about__ import __version__
from kvtier.storage.backends.base import BackendContext, StorageBackend
from kvtier.storage.manager import TieredStorageManager, create_storage_manager
from kvtier.storage.stats import StorageStats

__all__ = [
    "BackendContext",
    "StorageBackend",
    "StorageStats",
    "TieredStorageManager",
    "__version__",
    "create_storage_manager",
]

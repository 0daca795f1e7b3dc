"""kvtier core: keys, KV layout metadata, host memory objects, config, platforms, CacheEngine.

Importing this package imports torch, numpy and yaml only: no triton, no vLLM, no CUDA init.
"""

from kvtier.core.__about__ import __version__
from kvtier.core.config import KVTierConfig, load_config
from kvtier.core.engine import CacheEngine
from kvtier.core.errors import (
    ClosedError,
    ConfigError,
    DoubleReleaseError,
    KVTierError,
    LayoutError,
    MissingExtraError,
    OutOfHostMemory,
    PlatformError,
)
from kvtier.core.keys import ChunkKey, KeyFactory, KeyScope, prefix_hashes
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta
from kvtier.core.memory.handles import ChunkSpan, Hold, RetrieveJob
from kvtier.core.platform import Platform, get_platform
from kvtier.core.platform.mover import PageMover, TorchPageMover, Transfer
from kvtier.core.storage import HostMemoryStorageManager, StorageManager

__all__ = [
    "CacheEngine",
    "ChunkKey",
    "ChunkSpan",
    "ClosedError",
    "ConfigError",
    "DoubleReleaseError",
    "Hold",
    "HostArena",
    "HostMemoryStorageManager",
    "KVLayout",
    "KVTierConfig",
    "KVTierError",
    "KeyFactory",
    "KeyScope",
    "LayoutError",
    "MemoryObj",
    "MemoryObjMeta",
    "MissingExtraError",
    "OutOfHostMemory",
    "PageMover",
    "PagedLayout",
    "Platform",
    "PlatformError",
    "RetrieveJob",
    "StorageManager",
    "TorchPageMover",
    "Transfer",
    "__version__",
    "get_platform",
    "load_config",
    "prefix_hashes",
]

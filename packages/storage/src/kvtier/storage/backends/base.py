"""The backend interface: one tier of the StorageManager.

A backend is found by name in the ``kvtier.backends`` entry-point group and built with one
``BackendContext``. A third-party tier ships a package with
``[project.entry-points."kvtier.backends"] mytier = "pkg.mod:MyBackend"`` and is selected by
listing ``mytier`` in the config's ``tiers``; its own options come from
``backend_options: {mytier: {...}}``.

Ownership: ``batched_put`` borrows the caller's handles for the duration of the call (a backend
that keeps an object, as the host tier does, takes its own ``share()``). ``batched_get`` returns
new handles owned by the caller; a lower tier allocates them through the ``allocate`` callback it
is given (the manager's host arena, evicting cold host entries).

Failure: a lower tier never raises from ``contains``/``batched_get``/``batched_put``/``remove``
because its medium is slow, down, full or corrupt; it logs, counts, and answers a miss or skips
the store. Only programming errors raise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvtier.core.errors import ConfigError
from kvtier.core.storage import count_leading
from kvtier.storage.stats import StorageStats

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.keys import ChunkKey
    from kvtier.core.layout import KVLayout
    from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta
    from kvtier.storage.sealing import Sealer


@dataclass
class BackendContext:
    """What a backend is built from.

    ``namespace`` is the engine's key namespace (``ChunkKey.namespace()`` without the hash): a
    backend keeps its entries under it so engines of different models/layouts never meet.
    ``options`` is ``config.backend_options.get(<tier name>, {})``. ``sealer`` is set when
    ``encryption_key`` is: a tier that keeps serialized copies passes it to the codec (``seal``,
    ``decode_header``/``decode_into_object``/``split`` with ``sealer=``) and declares
    ``seals_payloads``.
    """

    config: KVTierConfig
    layout: KVLayout
    namespace: str
    arena: HostArena
    stats: StorageStats = field(default_factory=StorageStats)
    options: Mapping[str, Any] = field(default_factory=dict)
    sealer: Sealer | None = None


def refuse_options(ctx: BackendContext, tier: str, instead: str) -> None:
    """A ``ConfigError`` naming the first of ``ctx.options`` for a tier that takes none
    (``instead`` says where its settings are)."""
    if ctx.options:
        opt = sorted(ctx.options)[0]
        raise ConfigError(
            f"backend_options.{tier}.{opt}",
            ctx.options[opt],
            f"unknown option: the {tier} tier takes none ({instead})",
        )


class StorageBackend(ABC):
    """One tier. See the module docstring for the ownership and failure contract."""

    #: The tier name used in the config and in counters.
    name: ClassVar[str] = "backend"
    #: True for the host-memory tier: it keeps the very objects it is given and is written
    #: synchronously; every other tier holds serialized copies and is written in the background.
    keeps_host_objects: ClassVar[bool] = False
    #: True for a tier that seals its payloads when ``ctx.sealer`` is set; with
    #: ``encryption_key`` configured, a lower tier without it is a config error.
    seals_payloads: ClassVar[bool] = False

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key is held (a best guess: a later ``batched_get`` may still miss)."""

    def prefix_length(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys``, from the first, this tier holds contiguously."""
        return count_leading(self.contains(keys))

    @abstractmethod
    def batched_get(
        self,
        keys: Sequence[ChunkKey],
        allocate: Callable[[MemoryObjMeta], MemoryObj | None],
    ) -> list[MemoryObj | None]:
        """New handles (owned by the caller) for ``keys``; None for a miss."""

    @abstractmethod
    def batched_put(self, items: Sequence[tuple[ChunkKey, MemoryObj]]) -> None:
        """Store each object under its key; the caller keeps its handles."""

    @abstractmethod
    def remove(self, keys: Sequence[ChunkKey]) -> None:
        """Forget ``keys`` (missing ones are ignored)."""

    def watch_removals(self, listener: Callable[[list[str]], None]) -> bool:
        """Call ``listener(digests)`` with the ``ChunkKey.digest()`` of chunks this tier drops
        (evicted, rejected, removed); False if this tier cannot tell (a tier other engines also
        write, or whose server evicts on its own)."""
        return False

    def digests(self) -> list[str] | None:
        """``ChunkKey.digest()`` of every chunk this tier holds, when it can list them cheaply
        (a local tier); None when it cannot (a tier other engines also write). The vLLM
        connector seeds its scheduler's index of stored chunks with it at start."""
        return None

    def close(self) -> None:
        """Release what this tier holds (objects, files, connections)."""

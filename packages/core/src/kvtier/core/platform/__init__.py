"""Platforms and their discovery through the ``kvtier.platforms`` entry-point group.

A platform package declares ``[project.entry-points."kvtier.platforms"] NAME = "mod:probe"``. The
probe is cheap (no heavy import, no device initialisation) and returns the dotted path of the
platform class (``"pkg.mod:Class"``) when its hardware is usable, else ``None``. Classes are
imported only for platforms that are available, so importing kvtier never imports triton, vLLM
or initialises CUDA.

Choice: ``platform`` in the config (or ``KVTIER_PLATFORM``) names one; otherwise the available
platform with the highest ``priority`` wins. Two available platforms tied at the top priority is
an error that asks for an explicit choice. A probe that raises is logged and skipped.
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvtier.core.errors import PlatformError

if TYPE_CHECKING:
    from kvtier.core.layout import KVLayout
    from kvtier.core.memory import HostArena
    from kvtier.core.platform.mover import PageMover

logger = logging.getLogger("kvtier")

PLATFORM_GROUP = "kvtier.platforms"

# A device event (torch.cuda.Event, torch.xpu.Event, ...) or None where there is no stream.
Marker = Any


class Platform(ABC):
    """One kind of accelerator (or the CPU): where the KV cache lives and how chunks move."""

    name: ClassVar[str]
    priority: ClassVar[int]
    device_type: ClassVar[str]

    def __init__(self, device_index: int | None = None) -> None:
        self.device_index = device_index

    @property
    def device(self) -> torch.device:
        if self.device_index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, self.device_index)

    @property
    def has_pinned_memory(self) -> bool:
        """Whether host buffers should be page-locked for this platform's copies."""
        return False

    #: Whether ``pin_host_range`` can page-lock part of an existing buffer: then the arena is
    #: pinned in the background, segment by segment (``kvtier.core.memory.arena_growth``).
    pins_ranges: ClassVar[bool] = False
    #: Bytes page-locked per background step (``kvtier.core.memory.arena_growth.SEGMENT_BYTES``).
    pin_segment_bytes: ClassVar[int] = 256 << 20

    def create_arena(self, nbytes: int, *, pin_memory: bool = True) -> HostArena:
        """The host arena for this platform: one allocation, pinned where that helps. Where the
        platform pins ranges, the arena is usable at once and grows as it is pinned."""
        from kvtier.core.memory import HostArena

        pin = pin_memory and self.has_pinned_memory
        if not (pin and self.pins_ranges):
            return HostArena.create(nbytes, pin_memory=pin)
        from kvtier.core.memory.arena_growth import ArenaGrowth

        buffer = torch.empty(nbytes, dtype=torch.uint8)
        arena = HostArena(buffer, ready_bytes=0)
        arena.for_pinned_copies = True  # pinned segment by segment from now on
        base = buffer.data_ptr()
        ArenaGrowth(
            arena,
            lambda offset, n: self.pin_host_range(base + offset, n),
            lambda offset, n: self.unpin_host_range(base + offset, n),
            segment_bytes=self.pin_segment_bytes,
        ).start()
        return arena

    def pin_host_range(self, address: int, nbytes: int) -> bool:
        """Page-lock ``nbytes`` of host memory at ``address`` for this device's copies; False
        when refused (it stays pageable). Only called where ``pins_ranges``."""
        raise NotImplementedError(f"the {self.name} platform does not pin host ranges")

    def unpin_host_range(self, address: int, nbytes: int) -> None:
        """Undo ``pin_host_range``."""
        raise NotImplementedError(f"the {self.name} platform does not pin host ranges")

    @abstractmethod
    def create_mover(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        *,
        num_blocks: int | None = None,
        **options: object,
    ) -> PageMover:
        """A page mover over the engine's per-layer KV views (``kvtier.core.platform.mover``);
        ``num_blocks``: manager blocks in each view (default: as the views' shape says)."""

    def synchronize(self) -> None:
        """Wait for every copy this platform started (no-op on CPU)."""

    def record_marker(self) -> Marker:
        """Mark the work queued so far on the calling thread's current device stream.

        A page mover orders a transfer after the work on the *calling* thread's current
        stream. When KV computed on one thread (vLLM runs the model on a non-default stream of
        its main thread) is saved or overwritten from another, take a marker on the computing
        thread and pass it with the work (``CacheEngine.store(..., ready=marker)``): the other
        thread's stream then waits for it on the device (no host wait). ``None`` on the CPU,
        where transfers are synchronous host code.
        """
        if self.device_type == "cpu":
            return None
        module = torch.get_device_module(self.device_type)
        event = module.Event()
        event.record(module.current_stream(self.device))
        return event

    def wait_marker(self, marker: Marker) -> None:
        """Order the calling thread's current stream after ``marker`` (no-op for ``None``)."""
        if marker is None:
            return
        module = torch.get_device_module(self.device_type)
        module.current_stream(self.device).wait_event(marker)


def load_object(path: str) -> object:
    """Import ``"pkg.mod:attr"`` (or ``"pkg.mod.attr"``)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    obj: object = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def plugin_entry_points(group: str, allow: Iterable[str] | None = None) -> list[EntryPoint]:
    """Entry points of ``group``, narrowed by the allow-list (config ``plugins`` or
    ``KVTIER_PLUGINS``)."""
    eps = list(entry_points(group=group))
    allowed = set(allow or ())
    if allowed:
        eps = [ep for ep in eps if ep.name in allowed]
    seen: dict[str, EntryPoint] = {}
    for ep in eps:
        # the same distribution installed twice (editable + wheel) yields duplicate names
        seen.setdefault(ep.name, ep)
    return list(seen.values())


def discover_platforms(allow: Iterable[str] | None = None) -> dict[str, str | None]:
    """``{name: class path or None}`` for every declared platform; a failing probe maps to None."""
    found: dict[str, str | None] = {}
    for ep in plugin_entry_points(PLATFORM_GROUP, allow):
        try:
            probe: Callable[[], str | None] = ep.load()
            found[ep.name] = probe()
        except Exception as e:  # a broken plugin must not take kvtier down
            logger.warning(
                "kvtier platform plugin %r failed its probe and is skipped: %s", ep.name, e
            )
            found[ep.name] = None
    return found


def resolve_platform_class(
    name: str | None = None, allow: Iterable[str] | None = None
) -> type[Platform]:
    """The platform class to use: ``name`` if given, else the best available one."""
    found = discover_platforms(allow)
    if name:
        if name not in found:
            raise PlatformError(
                f"kvtier platform {name!r} is not installed (installed: {', '.join(sorted(found)) or 'none'}); "
                f"install kvtier[{name}] or pick another with KVTIER_PLATFORM"
            )
        path = found[name]
        if path is None:
            raise PlatformError(
                f"kvtier platform {name!r} was asked for (platform/KVTIER_PLATFORM) but its hardware "
                f"is not available on this machine"
            )
        return _load_platform(name, path)
    available = {n: _load_platform(n, p) for n, p in found.items() if p is not None}
    if not available:
        raise PlatformError("no kvtier platform is available (is kvtier-core installed?)")
    best = max(cls.priority for cls in available.values())
    top = sorted(n for n, cls in available.items() if cls.priority == best)
    if len(top) > 1:
        raise PlatformError(
            f"platforms {', '.join(top)} all claim this machine at priority {best}; "
            f"choose one with KVTIER_PLATFORM"
        )
    return available[top[0]]


def _load_platform(name: str, path: str) -> type[Platform]:
    cls = load_object(path)
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PlatformError(f"platform plugin {name!r} points at {path!r}, which is not a Platform")
    return cls


def get_platform(
    name: str | None = None, allow: Iterable[str] | None = None, device_index: int | None = None
) -> Platform:
    return resolve_platform_class(name, allow)(device_index)

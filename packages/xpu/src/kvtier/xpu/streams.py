"""Streams and events for the device a page mover's KV cache lives on, behind one small API.

The XPU page mover is written once against ``StreamAPI``: on ``xpu`` it drives ``torch.xpu``
streams and events; on ``cpu`` (the tests, and vLLM's CPU backend) every copy is already
synchronous, so streams and events are no-ops and the very same code path runs. Any other torch
device module with the same ``Stream``/``Event``/``stream``/``current_stream`` API (``cuda``)
works too, which lets the stream ordering be exercised on whatever accelerator is at hand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from kvtier.core.errors import PlatformError


class Event(Protocol):
    def synchronize(self) -> None: ...


class Stream(Protocol):
    def wait_stream(self, stream: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def record_event(self, event: Any = None) -> Any: ...
    def synchronize(self) -> None: ...


class _HostEvent:
    """A CPU "event": the work before it is already done when it is recorded."""

    def synchronize(self) -> None:
        pass


class _HostStream:
    """A CPU "stream": torch runs CPU ops eagerly, in issue order, on the calling thread."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


class StreamAPI:
    """Stream handling for one device: a side stream for copies, the engine's current stream,
    and making one wait for the other. Nothing here initialises the device until a stream is
    asked for."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mod: Any = None
        if device.type != "cpu":
            mod = getattr(torch, device.type, None)
            needed = ("Stream", "Event", "stream", "current_stream")
            if mod is None or not all(hasattr(mod, name) for name in needed):
                raise PlatformError(f"torch has no stream API for device type {device.type!r}")
            self._mod = mod

    @property
    def is_async(self) -> bool:
        """Whether copies can run behind the host's back (False on CPU)."""
        return self._mod is not None

    def new_stream(self) -> Stream:
        """A side stream on this device (a transfer stream of the mover)."""
        if self._mod is None:
            return _HostStream()
        stream: Stream = self._mod.Stream(device=self.device)
        return stream

    def current_stream(self) -> Stream:
        """The stream the engine is issuing work on right now (query it per transfer: the
        engine may switch streams between calls)."""
        if self._mod is None:
            return _HostStream()
        stream: Stream = self._mod.current_stream(self.device)
        return stream

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        """Issue the ops (and allocations) of the block on ``stream``."""
        if self._mod is None:
            yield
            return
        with self._mod.stream(stream):
            yield

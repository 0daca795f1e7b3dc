"""The bytes of a tier's host objects as memoryviews cut from one view of its arena's buffer.

``MemoryObj.byte_view()`` builds its view through three tensor ops and a numpy array, once for
every chunk a tier reads or writes; a slice of the arena's view is a pointer subtraction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.core.memory import HostArena, MemoryObj


class ArenaBytes:
    """``of(obj)`` is ``obj.byte_view()``: through the arena's view for objects of ``arena``,
    through the object for any other (valid until the object is released)."""

    def __init__(self, arena: HostArena) -> None:
        self.arena = arena
        self._base = arena.buffer.data_ptr()
        self._view = memoryview(arena.buffer.numpy())  # type: ignore[arg-type]

    def of(self, obj: MemoryObj) -> memoryview:
        if obj.arena is not self.arena:
            return obj.byte_view()
        start = obj.tensor.data_ptr() - self._base
        return self._view[start : start + obj.meta.nbytes]

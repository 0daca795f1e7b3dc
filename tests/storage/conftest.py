"""Storage test fixtures: a manager factory that closes every manager it made and checks that
the host arena ends fully free (no leaked handle)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from storage_helpers import ARENA_BYTES, LAYOUT, NAMESPACE, config

from kvtier.core.memory import HostArena
from kvtier.storage.manager import TieredStorageManager, tiered_storage_manager


@pytest.fixture
def make_manager(tmp_path) -> Iterator[Callable[..., TieredStorageManager]]:
    """``make_manager(arena_bytes=..., **config fields)``; closed (and checked) at teardown."""
    made: list[tuple[TieredStorageManager, HostArena]] = []

    def make(arena_bytes: int = ARENA_BYTES, **kw: Any) -> TieredStorageManager:
        arena = HostArena.create(arena_bytes)
        m = tiered_storage_manager(
            config=config(tmp_path, **kw), arena=arena, layout=LAYOUT, namespace=NAMESPACE
        )
        made.append((m, arena))
        return m

    yield make
    for m, arena in made:
        m.close()
        assert arena.used_bytes == 0, f"host arena leaked {arena.used_bytes} bytes"

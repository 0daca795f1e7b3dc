"""HostObjectLRU, the host tier's index (core's host-only manager and kvtier-storage's local_cpu):
random put/get/remove/evict sequences checked against a model of its recency order."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.core.keys import ChunkKey
from kvtier.core.memory import HostArena, MemoryObjMeta
from kvtier.core.memory.lru import HostObjectLRU

META = MemoryObjMeta((256,), torch.uint8, 1)  # one arena alignment unit
KEYS = st.integers(0, 5)


def key(i: int) -> ChunkKey:
    return ChunkKey("m", "fp", 1, 0, "s", f"{i:064x}")


class LRUMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.arena = HostArena.create(256 * 64)
        self.lru = HostObjectLRU()
        self.order: list[int] = []  # the model: keys, least recently used first
        self.version: dict[int, int] = {}
        self.borrowed: list[tuple[int, int, object]] = []  # (key, version, handle)
        self.next_version = 0

    def _borrows(self, k: int) -> int:
        return sum(1 for bk, bv, _ in self.borrowed if bk == k and bv == self.version[k])

    @rule(k=KEYS)
    def put(self, k: int) -> None:
        obj = self.arena.allocate(META)
        assert obj is not None
        self.lru.put([(key(k), obj)])
        obj.release()  # the index keeps its own handle
        if k in self.order:
            self.order.remove(k)
        self.order.append(k)
        self.version[k] = self.next_version
        self.next_version += 1

    @rule(k=KEYS)
    def get(self, k: int) -> None:
        (got,) = self.lru.get([key(k)])
        if k not in self.order:
            assert got is None
            return
        assert got is not None
        self.order.remove(k)
        self.order.append(k)
        self.borrowed.append((k, self.version[k], got))

    @rule(k=KEYS)
    def touch(self, k: int) -> None:
        """A read whose reader is done at once: only the recency order changes."""
        self.get(k)
        if self.borrowed and self.borrowed[-1][0] == k:
            self.borrowed.pop()[2].release()  # type: ignore[attr-defined]

    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        if self.borrowed:
            _, _, handle = self.borrowed.pop(data.draw(st.integers(0, len(self.borrowed) - 1)))
            handle.release()  # type: ignore[attr-defined]

    @rule(k=KEYS)
    def remove(self, k: int) -> None:
        self.lru.remove([key(k)])
        if k in self.order:
            self.order.remove(k)

    @rule()
    def evict_one(self) -> None:
        # The model: the first entry no reader holds goes; borrowed ones met first move to the end.
        victim = None
        for k in list(self.order):
            if self._borrows(k) == 0:
                victim = k
                break
            self.order.remove(k)
            self.order.append(k)
        assert self.lru.evict_one() is (victim is not None)
        if victim is not None:
            self.order.remove(victim)

    @invariant()
    def matches_the_model(self) -> None:
        assert self.lru.contains([key(k) for k in range(6)]) == [k in self.order for k in range(6)]
        assert len(self.lru) == len(self.order)
        assert self.lru.used_bytes == len(self.order) * META.nbytes
        # Bytes in use: the indexed objects plus replaced or evicted ones a reader still holds.
        live = {(k, self.version[k]) for k in self.order}
        held = {(bk, bv) for bk, bv, _ in self.borrowed}
        assert self.arena.used_bytes == len(live | held) * META.nbytes

    def teardown(self) -> None:
        for _, _, handle in self.borrowed:
            handle.release()  # type: ignore[attr-defined]
        self.lru.close()
        assert self.arena.used_bytes == 0
        obj = self.arena.allocate(META)
        assert obj is not None
        self.lru.put([(key(0), obj)])  # after close nothing is kept
        obj.release()
        assert self.arena.used_bytes == 0 and len(self.lru) == 0


LRUMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestHostObjectLRU = LRUMachine.TestCase

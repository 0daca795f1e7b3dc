"""HostObjectLRU, the host tier's index (core's host-only manager and kvtier-storage's local_cpu):
random put/get/remove/evict sequences checked against a model of its recency order, with chunks
whose alias entries age with them (``put_chunk``: a read of the chunk marks its aliases recently
used, and an alias of a borrowed chunk is not evicted)."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.core.keys import ChunkKey
from kvtier.core.memory import HostArena, MemoryObjMeta
from kvtier.core.memory.lru import HostObjectLRU

META = MemoryObjMeta((256,), torch.uint8, 1)  # one arena alignment unit
KEYS = st.integers(0, 9)
CHUNKS = st.integers(0, 5)
ALIASES = st.lists(st.integers(6, 9), unique=True, max_size=3)  # alias keys: 6-9


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
        self.links: dict[int, tuple[int, ...]] = {}  # chunk -> its aliases (the model's)
        self.owner: dict[int, int] = {}  # alias -> its chunk

    def _unlink(self, k: int) -> None:
        for a in self.links.pop(k, ()):
            self.owner.pop(a, None)
        c = self.owner.pop(k, None)
        if c is not None:
            rest = tuple(a for a in self.links.get(c, ()) if a != k)
            if rest:
                self.links[c] = rest
            else:
                self.links.pop(c, None)

    def _put_model(self, k: int) -> None:
        if k in self.order:
            self.order.remove(k)
            self._unlink(k)
        self.order.append(k)
        self.version[k] = self.next_version
        self.next_version += 1

    def _in_use(self, k: int) -> bool:
        c = self.owner.get(k)
        return self._borrows(k) > 0 or (c is not None and c in self.order and self._borrows(c) > 0)

    def _borrows(self, k: int) -> int:
        return sum(1 for bk, bv, _ in self.borrowed if bk == k and bv == self.version[k])

    @rule(k=KEYS)
    def put(self, k: int) -> None:
        obj = self.arena.allocate(META)
        assert obj is not None
        self.lru.put([(key(k), obj)])
        obj.release()  # the index keeps its own handle
        self._put_model(k)

    @rule(c=CHUNKS, aliases=ALIASES)
    def put_chunk(self, c: int, aliases: list[int]) -> None:
        objs = []
        for _ in range(1 + len(aliases)):
            obj = self.arena.allocate(META)
            assert obj is not None
            objs.append(obj)
        entries = [(key(a), o) for a, o in zip(aliases, objs[1:], strict=True)]
        self.lru.put_chunk(key(c), objs[0], entries)
        for o in objs:
            o.release()
        for k in (c, *aliases):
            self._put_model(k)
        if aliases:
            self.links[c] = tuple(aliases)
            self.owner.update((a, c) for a in aliases)

    @rule(k=KEYS)
    def get(self, k: int) -> None:
        (got,) = self.lru.get([key(k)])
        if k not in self.order:
            assert got is None
            return
        assert got is not None
        for m in (k, *(a for a in self.links.get(k, ()) if a in self.order)):
            self.order.remove(m)
            self.order.append(m)
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
            self._unlink(k)

    @rule()
    def evict_one(self) -> None:
        # The model: the first entry no reader holds (nor its chunk's) goes; those in use met
        # first move to the end.
        victim = None
        for k in list(self.order):
            if not self._in_use(k):
                victim = k
                break
            self.order.remove(k)
            self.order.append(k)
        assert self.lru.evict_one() is (victim is not None)
        if victim is not None:
            self.order.remove(victim)
            self._unlink(victim)

    @invariant()
    def matches_the_model(self) -> None:
        assert self.lru.contains([key(k) for k in range(10)]) == [
            k in self.order for k in range(10)
        ]
        assert self.lru.key_list() == [key(k) for k in self.order]
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
        # No link outlives its entries (a leak has no public surface: the maps themselves).
        assert not self.lru._aliases and not self.lru._chunk_of
        obj = self.arena.allocate(META)
        assert obj is not None
        self.lru.put([(key(0), obj)])  # after close nothing is kept
        obj.release()
        assert self.arena.used_bytes == 0 and len(self.lru) == 0


LRUMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestHostObjectLRU = LRUMachine.TestCase

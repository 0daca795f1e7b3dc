"""The disk tier's bookkeeping against a plain-list model, under arbitrary sequences of
operations (hypothesis): bytes counted equal the files indexed, a granted reservation fits the
budget, a file being read is never handed out for deletion, eviction is least recently used
first (a file being read that eviction passes over counts as just used)."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.storage.backends.disk.index import DiskIndex

NAMES = [f"f{i}" for i in range(6)]


def fake_stat(size: int, ino: int) -> os.stat_result:
    return os.stat_result((0o100600, ino, 0, 1, 0, 0, size, 0, 0, 0))


class Model:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.order: list[str] = []  # least recently used first
        self.sizes: dict[str, int] = {}
        self.reading: dict[str, int] = {}

    def used(self) -> int:
        return sum(self.sizes.values())

    def record(self, name: str, size: int) -> None:
        self.forget(name)
        self.order.append(name)
        self.sizes[name] = size

    def forget(self, name: str) -> None:
        if name in self.sizes:
            self.order.remove(name)
            del self.sizes[name]

    def evict(self, incoming: int, limit: int) -> tuple[bool, list[str]]:
        victims: list[str] = []
        skipped = 0
        while self.used() + incoming > limit and skipped < len(self.order):
            name = self.order[0]
            if self.reading.get(name):
                self.order.append(self.order.pop(0))
                skipped += 1
                continue
            self.forget(name)
            victims.append(name)
        return self.used() + incoming <= limit, victims


ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.sampled_from(NAMES), st.integers(1, 400)),
        st.tuples(st.just("reserve"), st.sampled_from(NAMES), st.integers(1, 900)),
        st.tuples(st.just("forget"), st.sampled_from(NAMES), st.just(0)),
        st.tuples(st.just("read"), st.sampled_from(NAMES), st.just(0)),
        st.tuples(st.just("done"), st.sampled_from(NAMES), st.just(0)),
        st.tuples(st.just("cap"), st.sampled_from(NAMES), st.integers(1, 900)),
    ),
    max_size=60,
)


@settings(max_examples=500, deadline=None)
@given(ops=ops, budget=st.integers(100, 2000))
def test_index_matches_the_model(ops, budget):
    idx = DiskIndex(budget, cap_s=3600.0)
    model = Model(budget)
    limit = budget
    for n, (op, name, size) in enumerate(ops):
        if op == "record":
            idx.record(name, fake_stat(size, n))
            model.record(name, size)
        elif op == "forget":
            idx.forget(name)
            model.forget(name)
        elif op == "read":
            idx.begin_read(name)
            model.reading[name] = model.reading.get(name, 0) + 1
        elif op == "done" and model.reading.get(name):
            idx.end_read(name)
            model.reading[name] -= 1
        elif op == "reserve":
            ok, victims = idx.reserve(size)
            want_ok, want_victims = model.evict(size, limit)
            assert (ok, victims) == (want_ok, want_victims)
            assert not any(model.reading.get(v) for v in victims)
            if ok:
                assert model.used() + size <= limit <= budget
                idx.unreserve(size)  # the write finished (or failed)
        elif op == "cap":  # the file system filled up while a write of ``size`` was reserved
            ok, first = idx.reserve(size)
            assert (ok, first) == model.evict(size, limit)
            cap, victims = idx.cap_at_used()
            assert cap == model.used()
            limit = min(budget, cap)  # files indexed without a reservation may exceed the budget
            if ok:
                _, want = model.evict(size, limit)
                assert victims == want
                idx.unreserve(size)
            else:
                assert victims == model.evict(0, limit)[1] == []
        assert idx.used == model.used()
        assert list(idx) == model.order

"""The Redis tier's servers: where each key lives, a connection pool per server, which servers
are down, and running one job per (server, connection) in parallel within one deadline.

A single server is a cluster of one node that owns every slot. In cluster mode the slot map is
read with ``CLUSTER SLOTS`` at the first call and again after a ``MOVED``/``ASK`` reply or a
failed node; a node that fails (refused, reset, timed out) is marked down for
``retry_interval_s``: its keys answer misses at once while the other nodes keep serving. Its idle
connections are closed with it (a restarted server has reset them all: reusing them one by one
would cost a failure and a down period each), so the next call opens a new one; the first new
connection after a failure is a reconnect (``on_reconnect``, counted as ``redis.reconnects``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

from kvtier.storage.backends.redis.cluster import SlotMap, key_slot
from kvtier.storage.backends.redis.resp import Connection, Deadline, Endpoint, Pool, ProtocolError

logger = logging.getLogger("kvtier.storage")

T = TypeVar("T")
Job = tuple[str, Callable[[Connection, Deadline], T]]


class NodeDown(ConnectionError):
    """The job's server is marked down (or unknown): it was not contacted."""


class Nodes:
    """See the module docstring. Thread-safe."""

    def __init__(
        self,
        seed: Endpoint,
        *,
        cluster: bool,
        connect_timeout_s: float,
        retry_interval_s: float,
        connections: int,
        on_error: Callable[[], None],
        on_reconnect: Callable[[], None] | None = None,
    ) -> None:
        self.seed = seed
        self.cluster = cluster
        self.connect_timeout_s = connect_timeout_s
        self.retry_interval_s = retry_interval_s
        self.connections = connections
        self._on_error = on_error
        self._on_reconnect = on_reconnect
        self._lost: set[str] = set()  # servers with a failed connection not yet opened again
        self._lock = threading.Lock()
        self._pools: dict[str, Pool] = {}
        self._down_until: dict[str, float] = {}
        self._down: set[str] = set()
        self._slots: SlotMap | None = None if cluster else SlotMap.single((seed.host, seed.port))
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    # -- routing -------------------------------------------------------------------------------
    def router(self, deadline: Deadline) -> Callable[[bytes], str | None] | None:
        """A function from a key to its server's address (None: no owner), or None when the
        cluster's slot map cannot be read now (every key misses)."""
        if not self.cluster:
            address = self.seed.address
            return lambda key: address
        slots = self._slot_map(deadline)
        if slots is None:
            return None

        def route(key: bytes) -> str | None:
            owner = slots.owner(key_slot(key))
            return None if owner is None else f"{owner[0]}:{owner[1]}"

        return route

    def _slot_map(self, deadline: Deadline) -> SlotMap | None:
        with self._lock:
            slots = self._slots
            wait = self._down_until.get("<slots>", 0.0) > time.monotonic()
        if slots is not None or wait:
            return slots
        known = [(h, p) for a in self._pools for h, _, p in [a.rpartition(":")] if p.isdigit()]
        try:
            slots = SlotMap.load(
                self.seed, self.connect_timeout_s, deadline, [(h, int(p)) for h, p in known]
            )
        except OSError as e:
            self._on_error()
            self._mark_down("<slots>", e)
            return None
        self._mark_up("<slots>")
        with self._lock:
            self._slots = slots
        return slots

    def topology_changed(self) -> None:
        """A MOVED/ASK reply or a failed node: read the slot map again at the next call."""
        if self.cluster:
            with self._lock:
                self._slots = None

    # -- running jobs --------------------------------------------------------------------------
    def run(self, jobs: Sequence[Job[T]], deadline: Deadline) -> list[T | BaseException]:
        """Run every job (address, fn(conn, deadline)) in parallel, each on its own connection;
        a job's result, or the exception it ended with (its connection is then closed)."""
        if not jobs:
            return []
        if len(jobs) == 1 or self._closed:
            return [self._run_one(job, deadline) for job in jobs]
        pool = self._pool_executor()
        futures: list[Future[T | BaseException] | Job[T]] = []
        for job in jobs[1:]:
            try:
                futures.append(pool.submit(self._run_one, job, deadline))
            except RuntimeError:  # closed meanwhile: the job answers NodeDown at once
                futures.append(job)
        try:
            first = self._run_one(jobs[0], deadline)
        finally:  # even if a job raised: no job may still be running once this returns
            wait([f for f in futures if isinstance(f, Future)])
        return [
            first,
            *(f.result() if isinstance(f, Future) else self._run_one(f, deadline) for f in futures),
        ]

    def _pool_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max(4, 4 * self.connections), thread_name_prefix="kvtier-redis"
                )
            return self._executor

    def _run_one(self, job: Job[T], deadline: Deadline) -> T | BaseException:
        address, fn = job
        if deadline.at <= time.monotonic():  # the call's time is spent: says nothing of the server
            return TimeoutError(f"the call's deadline passed before {address} was asked")
        pool = self._pool(address)
        if pool is None:
            return NodeDown(f"redis node {address} is marked down")
        try:
            conn = pool.get(deadline)
        except (OSError, ProtocolError) as e:
            self._failed(address, e)
            return e
        try:
            result = fn(conn, deadline)
        except (OSError, ProtocolError) as e:
            pool.put(conn, ok=False)
            self._failed(address, e)
            return e
        except BaseException:
            pool.put(conn, ok=False)
            raise
        pool.put(conn, ok=True)
        self._mark_up(address)
        return result

    def _pool(self, address: str) -> Pool | None:
        with self._lock:
            if self._closed or self._down_until.get(address, 0.0) > time.monotonic():
                return None
            pool = self._pools.get(address)
            if pool is None:
                ep = self.seed
                if self.cluster:
                    host, _, port = address.rpartition(":")
                    ep = self.seed.at(host, int(port))
                pool = self._pools[address] = Pool(
                    ep,
                    self.connect_timeout_s,
                    2 * self.connections,
                    on_connect=lambda: self._connected(address),
                )
            return pool

    # -- health --------------------------------------------------------------------------------
    def _failed(self, address: str, err: BaseException) -> None:
        self._on_error()
        with self._lock:
            self._lost.add(address)
            pool = self._pools.get(address)
        if pool is not None:
            pool.discard_idle()
        self._mark_down(address, err)
        self.topology_changed()

    def _connected(self, address: str) -> None:
        with self._lock:
            again = address in self._lost
            self._lost.discard(address)
        if again and self._on_reconnect is not None:
            self._on_reconnect()

    def _mark_down(self, address: str, err: BaseException) -> None:
        with self._lock:
            self._down_until[address] = time.monotonic() + self.retry_interval_s
            first = address not in self._down
            self._down.add(address)
        if first:
            logger.warning(
                "kvtier redis tier: %s is unreachable (%s: %s); its keys answer misses, retrying "
                "every %.1fs",
                address,
                type(err).__name__,
                err,
                self.retry_interval_s,
            )

    def _mark_up(self, address: str) -> None:
        if address in self._down:
            with self._lock:
                if address not in self._down:
                    return
                self._down.discard(address)
            logger.warning("kvtier redis tier: %s is reachable again", address)

    def close(self) -> None:
        """Close every connection; calls blocked on one end at once with an error."""
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
            executor, self._executor = self._executor, None
        for p in pools:
            p.close()
        if executor is not None:
            executor.shutdown(wait=False)

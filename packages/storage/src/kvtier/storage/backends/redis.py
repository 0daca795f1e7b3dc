"""The Redis/Valkey tier (single server or Redis Cluster), through redis-py.

Keys are ``<key_prefix><full chunk key string>`` (``key_prefix`` from
``backend_options.redis.key_prefix``, default ``"kvtier:"``); the chunk key string starts with
the engine's namespace (model, layout fingerprint, world size, rank, salt), so engines of
different models or layouts share a server without meeting. Values are ``codec`` payloads
(header + checksum), written with ``SET`` (``EX redis_ttl_s`` when set) in pipelines.

URLs: ``redis://``, ``rediss://`` (TLS) and ``unix://``; ``redis_username``/``redis_password``
override the URL's credentials; ``redis_cluster`` uses redis-py's cluster client (pipelines are
split per node by the client).

Faults: every call is bounded by ``redis_connect_timeout_s``/``redis_timeout_s`` and is not
retried by redis-py. A connection or timeout error marks the tier down: for
``retry_interval_s`` (``backend_options.redis``, default 1 s) every call answers a miss at once
without touching the network; then the next call tries again, so the tier comes back by itself
when the server does. A payload that fails its checks is a miss, counted (``redis.corrupt``),
logged and deleted. A server out of memory (or any other error reply) skips the store with a
warning.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.core.errors import ConfigError, MissingExtraError
from kvtier.storage import codec
from kvtier.storage._log import warn_throttled
from kvtier.storage.backends.base import BackendContext, StorageBackend

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.memory import MemoryObj, MemoryObjMeta

logger = logging.getLogger("kvtier.storage")

_OPTIONS = {"key_prefix", "retry_interval_s"}


def _import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise MissingExtraError("the redis storage backend (redis-py)", "redis") from None
    return redis


class RedisBackend(StorageBackend):
    """Chunks in Redis/Valkey. See the module docstring."""

    name = "redis"

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._redis = _import_redis()
        cfg = ctx.config
        if not cfg.redis_url:
            raise ConfigError("redis_url", cfg.redis_url, "the redis tier is enabled but has no URL")
        unknown = set(ctx.options) - _OPTIONS
        if unknown:
            raise ConfigError(
                "backend_options", dict(ctx.options),
                f"unknown redis option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}",
            )
        if cfg.redis_cluster and cfg.redis_url.startswith("unix://"):
            raise ConfigError("redis_url", cfg.redis_url, "a Redis Cluster is reached over TCP, not unix://")
        self.url = cfg.redis_url
        self.prefix = str(ctx.options.get("key_prefix", "kvtier:"))
        self.retry_interval_s = float(ctx.options.get("retry_interval_s", 1.0))
        if self.retry_interval_s < 0:
            raise ConfigError("backend_options", dict(ctx.options), "redis retry_interval_s must be >= 0")
        self.ttl = cfg.redis_ttl_s or None
        self.max_tokens = cfg.chunk_size
        self._lock = threading.Lock()
        self._client: Any = None
        self._down_until = 0.0
        self._down = False
        self._closed = False

    # -- connection ----------------------------------------------------------------------------
    def _client_kwargs(self, retries: int) -> dict[str, Any]:
        cfg = self.ctx.config
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kw: dict[str, Any] = {
            "socket_connect_timeout": cfg.redis_connect_timeout_s,
            "socket_timeout": cfg.redis_timeout_s,
            "retry": Retry(NoBackoff(), retries),
        }
        if cfg.redis_username is not None:
            kw["username"] = cfg.redis_username
        if cfg.redis_password is not None:
            kw["password"] = cfg.redis_password
        return kw

    def _connect(self) -> Any:
        if self.ctx.config.redis_cluster:
            # The cluster client reads the slot map from the URL's node when it is built; one
            # retry lets it follow a slot that moved.
            return self._redis.RedisCluster.from_url(self.url, **self._client_kwargs(1))
        # One attempt per call: a dead server must become a miss within one timeout, not
        # within retries x timeout.
        return self._redis.Redis.from_url(self.url, **self._client_kwargs(0))

    def _get_client(self) -> Any | None:
        """The client, or None while the tier is marked down (or after close)."""
        with self._lock:
            if self._closed or time.monotonic() < self._down_until:
                return None
            if self._client is None:
                try:
                    self._client = self._connect()
                except Exception as e:
                    self._mark_down_locked(e)
                    return None
            return self._client

    def _mark_down_locked(self, err: BaseException) -> None:
        self._down_until = time.monotonic() + self.retry_interval_s
        if not self._down:
            self._down = True
            logger.warning(
                "kvtier redis tier %s is unreachable (%s: %s); answering misses, retrying every %.1fs",
                self._safe_url(), type(err).__name__, err, self.retry_interval_s,
            )

    def _failed(self, what: str, err: BaseException) -> None:
        redis = self._redis
        self.ctx.stats.add(f"{self.name}.errors")
        if isinstance(err, redis.ConnectionError | redis.TimeoutError | OSError):
            with self._lock:
                self._mark_down_locked(err)
        else:
            warn_throttled(f"redis-{what}", "kvtier redis tier: %s failed: %s", what, err)

    def _ok(self) -> None:
        if self._down:
            with self._lock:
                if self._down:
                    self._down = False
                    logger.warning("kvtier redis tier %s is reachable again", self._safe_url())

    def _safe_url(self) -> str:
        head, sep, tail = self.url.rpartition("@")
        return f"{head.split('://')[0]}://***@{tail}" if sep else self.url

    def _key(self, key: ChunkKey) -> str:
        return self.prefix + key.to_string()

    def _pipeline(self, client: Any) -> Any:
        return client.pipeline(transaction=False)

    # -- interface -----------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        client = self._get_client()
        if client is None or not keys:
            return [False] * len(keys)
        try:
            pipe = self._pipeline(client)
            for k in keys:
                pipe.exists(self._key(k))
            found = [bool(n) for n in pipe.execute()]
        except Exception as e:
            self._failed("exists", e)
            return [False] * len(keys)
        self._ok()
        return found

    def batched_put(self, items: Sequence[tuple[ChunkKey, MemoryObj]]) -> None:
        client = self._get_client()
        if client is None or not items:
            if items:
                self.ctx.stats.add(f"{self.name}.store_skipped", len(items))
            return
        try:
            if self.ctx.config.redis_cluster:
                replies = self._put_pipelined(client, items)
            else:
                replies = self._put_streamed(client, items)
        except Exception as e:
            self._failed("set", e)
            self.ctx.stats.add(f"{self.name}.store_skipped", len(items))
            return
        self._ok()
        failed = [r for r in replies if isinstance(r, Exception)]
        if failed:
            self.ctx.stats.add(f"{self.name}.store_skipped", len(failed))
            warn_throttled("redis-set", "kvtier redis tier: %d chunk(s) not stored: %s", len(failed), failed[0])
        self.ctx.stats.add(f"{self.name}.stored", len(items) - len(failed))

    def _put_pipelined(self, client: Any, items: Sequence[tuple[ChunkKey, MemoryObj]]) -> list[Any]:
        """Cluster path: redis-py's cluster pipeline routes each SET to its node (one copy of
        each value is made to join header, payload and trailer)."""
        pipe = self._pipeline(client)
        for key, obj in items:
            payload = obj.byte_view()
            header, tail = codec.encode(key, obj.meta, self.ctx.layout, payload)
            pipe.set(self._key(key), b"".join((header, payload, tail)), ex=self.ttl)
        return pipe.execute(raise_on_error=False)

    def _put_streamed(self, client: Any, items: Sequence[tuple[ChunkKey, MemoryObj]]) -> list[Any]:
        """Single-server path: pipelined SETs written as RESP on one pooled connection, each
        payload sent straight from host memory (no copy) while its checksum is computed on a
        helper thread; the trailer follows once both are done."""
        ex = [b"EX", str(self.ttl).encode()] if self.ttl else []
        ex_resp = b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in ex)
        pool = client.connection_pool
        conn = pool.get_connection()
        pending: list[codec.Checksum] = []
        try:
            for key, obj in items:
                payload = obj.byte_view()
                header = codec.encode_header(key, obj.meta, self.ctx.layout)
                cs = codec.Checksum(zlib.crc32(header))
                pending.append(cs)
                cs.add(payload)
                k = self._key(key).encode()
                size = len(header) + payload.nbytes + codec.TRAILER.size
                head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(ex), len(k), k, size)
                conn.send_packed_command([head + header, payload])
                conn.send_packed_command([codec.TRAILER.pack(cs.value()) + b"\r\n" + ex_resp])
            replies: list[Any] = []
            for _ in items:
                try:
                    replies.append(conn.read_response())
                except self._redis.ResponseError as e:
                    replies.append(e)
            return replies
        except BaseException:
            conn.disconnect()
            raise
        finally:
            for cs in pending:  # the caller's buffers must not be read after we return
                cs.wait()
            pool.release(conn)

    def batched_get(
        self,
        keys: Sequence[ChunkKey],
        allocate: Callable[[MemoryObjMeta], MemoryObj | None],
    ) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = [None] * len(keys)
        client = self._get_client()
        if client is None or not keys:
            return out
        try:
            pipe = self._pipeline(client)
            for k in keys:
                pipe.get(self._key(k))
            blobs = pipe.execute()
        except Exception as e:
            self._failed("get", e)
            return out
        self._ok()
        bad: list[ChunkKey] = []
        for i, (key, blob) in enumerate(zip(keys, blobs, strict=True)):
            if blob is None:
                continue
            try:
                out[i] = self._decode_into(key, blob, allocate)
            except codec.PayloadError as e:
                self.ctx.stats.add(f"{self.name}.corrupt")
                logger.warning("kvtier redis tier: value of %s rejected (%s); deleted", key.to_string(), e.reason)
                bad.append(key)
        if bad:
            self.remove(bad)
        return out

    def _decode_into(
        self, key: ChunkKey, blob: bytes, allocate: Callable[[MemoryObjMeta], MemoryObj | None]
    ) -> MemoryObj | None:
        """A new host object holding ``blob``'s payload; the checksum runs while it is copied."""
        obj = codec.decode_into_object(blob, key=key, layout=self.ctx.layout,
                                       max_tokens=self.max_tokens, allocate=allocate)
        if obj is None:
            self.ctx.stats.add(f"{self.name}.no_host_memory")
        return obj

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        client = self._get_client()
        if client is None or not keys:
            return
        try:
            pipe = self._pipeline(client)
            for k in keys:
                pipe.delete(self._key(k))
            pipe.execute()
        except Exception as e:
            self._failed("delete", e)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as e:
                logger.debug("kvtier redis tier: close failed: %s", e)

"""A binary-safe Redis client for what the tests read and damage behind the tier's back, on
kvtier's own RESP connection (kvtier ships no other Redis client): values come back as bytes,
an error reply raises. One connection per command."""

from __future__ import annotations

from typing import Any

from kvtier.storage.backends.redis_resp import Connection, Deadline, RespError
from kvtier.storage.backends.redis_url import parse_url

TIMEOUT_S = 5.0


class RedisClient:
    """``client(*args)`` runs one command on the server of ``url``; the named methods are the
    few the tests use."""

    def __init__(self, url: str, password: str | None = None) -> None:
        self.endpoint = parse_url(url, None, password)

    def __call__(self, *args: bytes | str | int) -> Any:
        deadline = Deadline(TIMEOUT_S)
        conn = Connection(self.endpoint, TIMEOUT_S, deadline)
        try:
            reply = conn.call(args, deadline)
        finally:
            conn.close()
        if isinstance(reply, RespError):
            raise reply
        return reply

    def get(self, name: str) -> bytes | None:
        return self("GET", name)

    def set(self, name: str, value: bytes) -> None:
        self("SET", name, value)

    def delete(self, *names: str) -> int:
        return self("DEL", *names)

    def exists(self, *names: str) -> int:
        return self("EXISTS", *names)

    def keys(self, pattern: str = "*") -> list[bytes]:
        return self("KEYS", pattern)

    def ttl(self, name: str) -> int:
        return self("TTL", name)

    def strlen(self, name: str) -> int:
        return self("STRLEN", name)

"""Where the Redis tier's servers are: ``Endpoint`` (TCP host and port or a unix socket, TLS,
credentials, database) and ``parse_url`` for ``redis://``, ``rediss://`` and ``unix://`` URLs.
A bad URL is a ``ConfigError`` naming ``redis.url``, its password masked."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from kvtier.core.errors import ConfigError


@dataclass(frozen=True)
class Endpoint:
    """Where and how to connect: TCP ``host:port`` or a unix socket ``path``; TLS when ``tls``."""

    host: str = ""
    port: int = 0
    path: str = ""
    tls: ssl.SSLContext | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a log line
    db: int = 0

    def at(self, host: str, port: int) -> Endpoint:
        """The same credentials and TLS settings for another node (a cluster's)."""
        return Endpoint(host, port, "", self.tls, self.username, self.password, 0)

    @property
    def address(self) -> str:
        return self.path or f"{self.host}:{self.port}"


def parse_url(url: str, username: str | None, password: str | None) -> Endpoint:
    """``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS; query ``ssl_cert_reqs=none``,
    ``ssl_ca_certs=``, ``ssl_certfile=``, ``ssl_keyfile=``) or ``unix:///path.sock[?db=N]``.
    ``username``/``password`` (the config's) override the URL's."""
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    user = (
        username if username is not None else (unquote(parts.username) if parts.username else None)
    )
    pw = password if password is not None else (unquote(parts.password) if parts.password else None)
    safe = _masked(url)
    try:
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError("no socket path")
            return Endpoint(
                path=parts.path, username=user, password=pw, db=int(query.get("db", "0"))
            )
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"unknown scheme {parts.scheme!r}")
        port = parts.port or 6379  # raises ValueError for a port out of range
        db = int(parts.path.strip("/") or query.get("db", "0"))
    except ValueError as e:
        raise ConfigError("redis_url", safe, str(e)) from None
    if not parts.hostname:
        raise ConfigError("redis_url", safe, "no host")
    tls = _tls_context(query) if parts.scheme == "rediss" else None
    return Endpoint(parts.hostname, port, "", tls, user, pw, db)


def _tls_context(query: dict[str, str]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=query.get("ssl_ca_certs"))
    if query.get("ssl_certfile"):
        ctx.load_cert_chain(query["ssl_certfile"], query.get("ssl_keyfile"))
    if query.get("ssl_cert_reqs", "required").lower() == "none":
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _masked(url: str) -> str:
    head, sep, tail = url.rpartition("@")
    return f"{head.split('://')[0]}://***@{tail}" if sep else url

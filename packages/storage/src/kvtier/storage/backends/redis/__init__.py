"""The Redis / Valkey tier (``backend.RedisBackend``) and its parts: kvtier's own RESP client
(``resp``), the servers of a cluster (``nodes``, ``cluster``), the value format (``format``),
reads and writes split into pipelined jobs (``dispatch``, ``jobs``), one chunk's read
(``chunk``) and URL parsing (``url``)."""

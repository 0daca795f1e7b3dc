"""Redis Cluster routing for the Redis tier: hash slots and the slot map.

A key's slot is CRC16 (XMODEM) of its hash tag (the part between the first ``{`` and the next
``}``, when not empty; else the whole key) modulo 16384, as the server computes it. The tier
puts a chunk's head and segments under one hash tag, so a chunk lives on one shard.
"""

from __future__ import annotations

from kvtier.storage.backends.redis.resp import Connection, Deadline, Endpoint, RespError

SLOTS = 16384


def _table() -> list[int]:
    out = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        out.append(crc & 0xFFFF)
    return out


_CRC16 = _table()


def crc16(data: bytes) -> int:
    crc = 0
    for b in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ b) & 0xFF]
    return crc


def key_slot(key: bytes) -> int:
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return crc16(key) % SLOTS


class SlotMap:
    """Which master serves each slot, read from ``CLUSTER SLOTS`` of any reachable node."""

    def __init__(self, owners: list[tuple[str, int] | None]) -> None:
        self.owners = owners

    @classmethod
    def single(cls, address: tuple[str, int]) -> SlotMap:
        return cls([address] * SLOTS)

    @classmethod
    def load(
        cls,
        seed: Endpoint,
        connect_timeout_s: float,
        deadline: Deadline,
        known: list[tuple[str, int]],
    ) -> SlotMap:
        """The map from the first node (the URL's, then ``known`` ones) that answers."""
        errors: list[str] = []
        for host, port in [(seed.host, seed.port), *known]:
            try:
                conn = Connection(seed.at(host, port), connect_timeout_s, deadline)
            except OSError as e:
                errors.append(f"{host}:{port}: {e}")
                continue
            try:
                reply = conn.call(["CLUSTER", "SLOTS"], deadline)
            except OSError as e:
                errors.append(f"{host}:{port}: {e}")
                continue
            finally:
                conn.close()
            if isinstance(reply, RespError) or not isinstance(reply, list):
                errors.append(f"{host}:{port}: CLUSTER SLOTS answered {reply!r}")
                continue
            return cls._from_reply(reply, host)
        raise ConnectionError("no cluster node answered CLUSTER SLOTS: " + "; ".join(errors))

    @classmethod
    def _from_reply(cls, reply: list[object], asked: str) -> SlotMap:
        owners: list[tuple[str, int] | None] = [None] * SLOTS
        for entry in reply:
            if not isinstance(entry, list) or len(entry) < 3 or not isinstance(entry[2], list):
                continue
            start, end, master = entry[0], entry[1], entry[2]
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
            # an empty host means "the address you asked" (a node that does not know its own IP)
            addr = (host or asked, int(master[1]))
            for s in range(int(start), int(end) + 1):
                owners[s] = addr
        return cls(owners)

    def nodes(self) -> list[tuple[str, int]]:
        return sorted({a for a in self.owners if a is not None})

    def owner(self, slot: int) -> tuple[str, int] | None:
        return self.owners[slot]

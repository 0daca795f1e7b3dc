"""One chunk being read by the Redis tier: where each of its segments lands, its checksum, and,
for a sealed chunk (``encryption_key``), its authentication tag.

A plain chunk's segments land straight in the host object that will hold it. A sealed chunk's
stored payload is its ciphertext followed by a 16-byte tag, one tag longer than the object:
the segments that lie wholly within the ciphertext land in the object, the one or two that
reach into the tag land in a small side buffer, whose ciphertext part is copied into the object
once every segment is there. The checksum covers ciphertext and tag as they were stored, and
only after it matches is the ciphertext decrypted in place and its tag checked.

The checksum is hashed by the threads that read the segments, each segment right after it lands
(still in that core's cache, while the connection's next segment is on its way), when the
segment size is a multiple of the checksum's piece (``codec.SEGMENT``; the default 1 MiB is);
otherwise the whole payload is hashed once its last segment lands.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvtier.storage import codec
from kvtier.storage.backends.redis.format import segment_count

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.memory import MemoryObj
    from kvtier.storage.sealing import Sealer


class ChunkRead:
    """One chunk of a ``batched_get``: ``segment_view(s)`` is where segment ``s`` lands;
    ``landed(s, problem)`` is called once per segment (from the thread that read it); ``check``
    checks the whole chunk once every segment has landed (or failed). ``failed`` says why it is a
    miss."""

    def __init__(
        self,
        index: int,
        head: codec.Header,
        trailer: bytes,
        obj: MemoryObj,
        segment_bytes: int,
        view: memoryview,
    ) -> None:
        self.index = index
        self.head = head
        self.trailer = trailer
        self.obj = obj
        self.view = view  # obj's bytes
        self.segment_bytes = segment_bytes
        self.segments = segment_count(head.payload_len, segment_bytes)
        self.failed: str | None = None
        self.tag = b""
        self._sum = codec.PlacedChecksum(head.crc_of_header, head.payload_len)
        self._per_segment = segment_bytes % codec.SEGMENT == 0
        self._pending = self.segments
        self._lock = threading.Lock()
        self._tail: memoryview | None = None
        self._tail_at = 0
        if head.sealed:
            self._tail_at = self.view.nbytes // segment_bytes * segment_bytes
            self._tail = memoryview(bytearray(head.payload_len - self._tail_at))

    def segment_view(self, s: int) -> memoryview:
        start = s * self.segment_bytes
        end = start + self.segment_bytes
        if self._tail is None or min(end, self.head.payload_len) <= self.view.nbytes:
            return self.view[start:end]
        return self._tail[start - self._tail_at : end - self._tail_at]

    def landed(self, s: int, problem: str | None) -> None:
        """Segment ``s`` was read (``problem``: why it is unusable); hash it here, on the thread
        that read it. After the last one, a sealed chunk's tail is put in place."""
        if problem is None and self._per_segment:
            self._sum.add_now(s * self.segment_bytes, self.segment_view(s))
        with self._lock:
            if problem is not None and self.failed is None:
                self.failed = problem
            self._pending -= 1
            last = self._pending == 0 and self.failed is None
        if not last:
            return
        if self._tail is not None:
            inside = self.view.nbytes - self._tail_at
            self.view[self._tail_at :] = self._tail[:inside]
            self.tag = bytes(self._tail[inside:])
        if not self._per_segment:
            self._hash_whole()

    def _hash_whole(self) -> None:
        """The payload as stored (the object, then a sealed chunk's tag), hashed at once."""
        if self._tail is None:
            self._sum.add_now(0, self.view)
            return
        whole = self.view.nbytes // codec.SEGMENT * codec.SEGMENT
        self._sum.add_now(0, self.view[:whole])
        self._sum.add_now(whole, bytes(self.view[whole:]) + self.tag)

    def fail(self, problem: str) -> None:
        with self._lock:
            if self.failed is None:
                self.failed = problem

    def check(self, key: ChunkKey, sealer: Sealer | None) -> None:
        """Check the checksum and (sealed) decrypt in place and check the tag; call once every
        segment has landed or failed. Sets ``failed`` on a mismatch (the object then holds
        garbage: release it)."""
        if self.failed is not None:
            return
        try:
            codec.check_trailer(self._sum.value(), self.trailer)
            if self.head.sealed:
                assert sealer is not None  # parse_head refuses a sealed head without one
                codec.unseal_in_place(self.head, self.view, self.tag, key, sealer)
        except codec.PayloadError as e:
            self.failed = e.reason

"""Encryption at rest (opt-in, ``encryption_key``): payloads that leave the process are sealed
with AES-256-GCM through the ``cryptography`` package (``pip install kvtier[encryption]``).

Each cache salt gets its own key, derived from the master key by HKDF-SHA256 with the salt's id
as context, so one tenant's chunks cannot be opened with another's key. Every value has a fresh
random 96-bit nonce (in its header), and the whole header (key, layout, shape, nonce) is the
additional authenticated data: a sealed payload moved under another key, or a header edited,
fails its tag. A failed tag is a ``PayloadError`` (a miss, counted and removed by the tier).
The header also carries a key check (an HMAC of the nonce under a second key derived for the
salt), so a lookup tells a chunk sealed under another key from one it can open without reading
the payload.
The header itself stays readable (it names the key), the payload and its length do not leak
more than the layout already says.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from typing import Any

from kvtier.core.errors import MissingExtraError

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
_INFO = b"kvtier-seal-v1\x00salt\x00"


class SealError(ValueError):
    """A sealed payload failed its authentication tag (wrong key, or tampered)."""


def _aead() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise MissingExtraError(
            "encryption at rest (the cryptography package)", "encryption"
        ) from None
    return AESGCM


class Sealer:
    """Seals and opens payloads with per-salt keys derived from one 32-byte master key."""

    def __init__(self, master_key: bytes) -> None:
        if len(master_key) != KEY_BYTES:
            raise ValueError(f"an encryption key is {KEY_BYTES} bytes, got {len(master_key)}")
        self._aesgcm = _aead()
        self._master = bytes(master_key)
        self._keys: dict[str, Any] = {}
        self._subkeys: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "Sealer(***)"

    def _derived(self, salt_id: str) -> bytes:
        """The salt's 64 derived bytes: its AES key, then its key-check key."""
        with self._lock:
            key = self._subkeys.get(salt_id)
            if key is None:
                from cryptography.hazmat.primitives import hashes
                from cryptography.hazmat.primitives.kdf.hkdf import HKDF

                key = HKDF(
                    algorithm=hashes.SHA256(),
                    length=2 * KEY_BYTES,
                    salt=None,
                    info=_INFO + salt_id.encode(),
                ).derive(self._master)
                self._subkeys[salt_id] = key
            return key

    def _subkey(self, salt_id: str) -> bytes:
        return self._derived(salt_id)[:KEY_BYTES]

    def key_check(self, salt_id: str, nonce: bytes) -> str:
        """A short value in a sealed header that says, without touching the payload, whether
        this sealer's key for the salt sealed it (so a lookup does not count a chunk sealed
        under another key as a hit)."""
        mac = hmac.new(
            self._derived(salt_id)[KEY_BYTES:], b"kvtier-kcv\x00" + nonce, hashlib.sha256
        )
        return mac.hexdigest()[:16]

    def _cipher(self, salt_id: str) -> Any:
        with self._lock:
            cipher = self._keys.get(salt_id)
        if cipher is None:
            cipher = self._aesgcm(self._subkey(salt_id))
            with self._lock:
                self._keys[salt_id] = cipher
        return cipher

    @staticmethod
    def new_nonce() -> bytes:
        return os.urandom(NONCE_BYTES)

    def seal(self, salt_id: str, nonce: bytes, aad: bytes, payload: memoryview | bytes) -> bytes:
        """``payload`` encrypted, followed by its 16-byte tag."""
        return self._cipher(salt_id).encrypt(nonce, payload, aad)

    def open_in_place(
        self,
        salt_id: str,
        nonce: bytes,
        aad: bytes,
        data: memoryview,
        tag: bytes,
        piece: int = 1 << 20,
    ) -> None:
        """Decrypt ``data`` (the ciphertext) in place, a piece at a time, then check ``tag``;
        ``SealError`` if it fails (``data`` then holds garbage: the caller drops it)."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        dec = Cipher(algorithms.AES(self._subkey(salt_id)), modes.GCM(nonce, tag)).decryptor()
        dec.authenticate_additional_data(aad)
        n = data.nbytes
        last = (n - 1) // piece * piece if n else 0  # the last piece goes through a small
        # buffer: update_into wants 15 bytes of slack after what it writes
        for start in range(0, last, piece):
            dec.update_into(data[start : start + piece], data[start : start + piece + 15])
        tail = bytearray(n - last + 15)
        done = dec.update_into(data[last:], tail)
        data[last:] = tail[:done]
        try:
            dec.finalize()
        except InvalidTag:
            raise SealError("sealed: authentication failed (another key, or tampered)") from None

    def open(self, salt_id: str, nonce: bytes, aad: bytes, sealed: memoryview | bytes) -> bytes:
        """The plaintext of ``sealed`` (ciphertext + tag); ``SealError`` if the tag fails."""
        from cryptography.exceptions import InvalidTag

        try:
            return self._cipher(salt_id).decrypt(nonce, sealed, aad)
        except InvalidTag:
            raise SealError("sealed: authentication failed (another key, or tampered)") from None

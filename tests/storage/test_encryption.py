"""Encryption at rest (``encryption_key``): disk payloads are sealed with AES-256-GCM under
per-salt keys; a wrong key, a tampered payload, a plain value in an encrypted tier are misses,
counted; bad keys are config errors that never show the key."""

from __future__ import annotations

import os
import struct
import zlib

import pytest
from storage_helpers import (
    LAYOUT,
    NAMESPACE,
    check_obj,
    chunk_value,
    config,
    disk_of,
    key,
    meta,
    stored,
)

pytest.importorskip("cryptography")

from kvtier.core.errors import ConfigError
from kvtier.core.keys import KeyFactory
from kvtier.core.memory import HostArena
from kvtier.storage import codec
from kvtier.storage.manager import tiered_storage_manager
from kvtier.storage.sealing import Sealer

KEY_A = "11" * 32
KEY_B = "22" * 32


def test_sealed_round_trip_and_restart(make_manager):
    m = make_manager(encryption_key=KEY_A)
    stored(m, 0, 1)
    plain = chunk_value(0).view(-1).numpy().tobytes()
    data = disk_of(m).path_of(key(0)).read_bytes()
    assert plain[:4096] not in data and plain[-4096:] not in data  # no plaintext on disk
    obj = m.get(key(0))
    check_obj(obj, 0)
    obj.release()
    m.close()
    m2 = make_manager(encryption_key=KEY_A)
    assert m2.prefix_hits([key(0), key(1)]) == 2
    for i in (0, 1):
        obj = m2.get(key(i))
        check_obj(obj, i)
        obj.release()


def test_o_direct_sealed_round_trip(make_manager):
    m = make_manager(encryption_key=KEY_A, local_disk_o_direct=True)
    stored(m, 3)
    obj = m.get(key(3))
    check_obj(obj, 3)
    obj.release()


@pytest.mark.parametrize("reader", ["other_key", "no_key"])
def test_another_key_or_none_is_a_counted_miss(make_manager, tmp_path, reader):
    m = make_manager(encryption_key=KEY_A)
    stored(m, 0)
    m.close()
    m2 = make_manager(**({"encryption_key": KEY_B} if reader == "other_key" else {}))
    assert m2.prefix_hits([key(0)]) == 0  # a lookup already knows (the header's key check)
    assert m2.get(key(0)) is None
    assert m2.stats.get("local_disk.sealed_rejected") == 1


def test_a_plain_value_is_refused_when_encryption_is_on(make_manager):
    m = make_manager()
    stored(m, 0)
    m.close()
    m2 = make_manager(encryption_key=KEY_A)
    assert m2.contains([key(0)]) == [False]
    assert m2.get(key(0)) is None
    assert m2.stats.get("local_disk.sealed_rejected") == 1


def test_tampered_ciphertext_with_a_good_checksum_fails_its_tag(make_manager):
    m = make_manager(encryption_key=KEY_A)
    stored(m, 0)
    path = disk_of(m).path_of(key(0))
    data = bytearray(path.read_bytes())
    header_len, payload_len = codec.prefix_lengths(data)
    data[header_len + 10] ^= 0x01
    # recompute the checksum, as a writer who knows the format (not the key) would
    cs = codec.Checksum(zlib.crc32(bytes(data[:header_len])))
    cs.add(memoryview(data)[header_len : header_len + payload_len])
    data[-4:] = struct.pack("<I", cs.value())
    path.write_bytes(bytes(data))
    assert m.get(key(0)) is None
    assert m.stats.get("local_disk.sealed_rejected") == 1
    assert not path.exists()


def test_per_salt_keys_and_header_binding():
    sealer = Sealer(bytes.fromhex(KEY_A))
    ka = KeyFactory("m", LAYOUT.fingerprint()).key(b"\x01" * 16, "tenant-a")
    kb = KeyFactory("m", LAYOUT.fingerprint()).key(b"\x01" * 16, "tenant-b")
    payload = memoryview(bytes(range(256)) * (meta().nbytes // 256))
    header, sealed = codec.seal(ka, meta(), LAYOUT, payload, sealer)
    h = codec.decode_header(header, key=ka, layout=LAYOUT, max_tokens=16, sealer=sealer)
    assert codec.unseal(h, sealed, ka, sealer) == bytes(payload)
    with pytest.raises(codec.PayloadError, match="authentication"):  # tenant b's key
        codec.unseal(h, sealed, kb, sealer)
    other = Sealer(bytes.fromhex(KEY_B))
    with pytest.raises(codec.PayloadError, match="authentication"):
        codec.unseal(h, sealed, ka, other)
    with pytest.raises(codec.PayloadError, match="sealed"):
        codec.decode_header(header, key=ka, layout=LAYOUT, max_tokens=16)


@pytest.mark.parametrize("bad", ["00" * 31, "zz" * 32, "not base64!", "QUJD"])
def test_bad_keys_are_config_errors_that_do_not_show_the_key(tmp_path, bad):
    with pytest.raises(ConfigError) as exc:
        config(tmp_path, encryption_key=bad)
    assert exc.value.field == "encryption_key"
    assert bad not in str(exc.value)


def test_key_file(tmp_path):
    f = tmp_path / "kvtier.key"
    f.write_text(KEY_A + "\n")
    os.chmod(f, 0o600)
    cfg = config(tmp_path, encryption_key_file=str(f))
    assert cfg.encryption_key_bytes() == bytes.fromhex(KEY_A)
    with pytest.raises(ConfigError, match="encryption_key_file"):
        config(tmp_path, encryption_key_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="not both"):
        config(tmp_path, encryption_key_file=str(f), encryption_key=KEY_A)
    assert KEY_A not in repr(config(tmp_path, encryption_key=KEY_A))


def test_a_tier_that_cannot_seal_is_a_config_error(tmp_path, monkeypatch):
    """A third-party tier that does not declare ``seals_payloads`` (here: the base class, as
    registered by a plugin) is refused while a key is set."""
    from importlib.metadata import EntryPoint

    from kvtier.core import platform as platform_mod

    real = platform_mod.entry_points
    plain = EntryPoint(
        "plain_tier", "kvtier.storage.backends.base:StorageBackend", "kvtier.backends"
    )
    monkeypatch.setattr(
        platform_mod,
        "entry_points",
        lambda *, group: [*real(group=group), *([plain] if group == "kvtier.backends" else [])],
    )
    cfg = config(tmp_path, tiers=["local_cpu", "plain_tier"], encryption_key=KEY_A)
    arena = HostArena.create(1 << 20)
    with pytest.raises(ConfigError, match="'plain_tier' tier cannot seal"):
        tiered_storage_manager(config=cfg, arena=arena, layout=LAYOUT, namespace=NAMESPACE)


@pytest.mark.parametrize("tokens", [256, 200, 3])
def test_sealed_files_of_many_segments_read_back(tmp_path, tokens):
    """Ciphertext spanning several checksum segments, with the tag in its own segment (256) or
    sharing the last one (200, 3), is read, checked and decrypted in place."""
    import torch

    from kvtier.core.layout import KVLayout
    from kvtier.core.memory import MemoryObjMeta
    from kvtier.storage.backends.disk.fileio import read_chunk

    layout = KVLayout(
        num_layers=2,
        num_kv_heads=8,
        head_size=128,
        dtype="float16",
        block_size=1,
        paged_layout="LBHNC",
    )
    m = MemoryObjMeta(layout.chunk_shape(tokens), layout.chunk_dtype, tokens)
    arena = HostArena.create(4 * m.nbytes + (1 << 16))
    src = arena.allocate(m)
    src.tensor.copy_(torch.randn(m.shape, generator=torch.Generator().manual_seed(tokens)).half())
    sealer = Sealer(bytes.fromhex(KEY_A))
    k = KeyFactory("m", layout.fingerprint()).key(b"\x02" * 16, "s")
    header, sealed = codec.seal(k, m, layout, src.byte_view(), sealer)
    path = tmp_path / "c.kvc"
    path.write_bytes(header + sealed + codec.trailer(header, sealed))
    fd = os.open(path, os.O_RDONLY)
    try:
        obj = read_chunk(
            fd,
            path.stat().st_size,
            key=k,
            layout=layout,
            max_tokens=256,
            allocate=arena.allocate,
            sealer=sealer,
        )
        assert obj is not None and torch.equal(obj.tensor, src.tensor)
        obj.release()
        with pytest.raises(codec.PayloadError, match="another key"):
            read_chunk(
                fd,
                path.stat().st_size,
                key=k,
                layout=layout,
                max_tokens=256,
                allocate=arena.allocate,
                sealer=Sealer(bytes.fromhex(KEY_B)),
            )
    finally:
        os.close(fd)
    src.release()
    assert arena.used_bytes == 0

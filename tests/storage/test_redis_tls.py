"""The Redis tier over TLS (``rediss://``) to a real redis-server with a certificate made here."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from storage_helpers import check_obj, key
from test_redis import redis_manager, stored

from fixtures.redis_server import RedisServer, free_port

pytestmark = pytest.mark.redis


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def tls_server(tmp_path):
    if shutil.which("openssl") is None or shutil.which("redis-server") is None:
        pytest.skip("openssl and redis-server are needed for the TLS test")
    d = tmp_path / "pki"
    d.mkdir()
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=kvtier-test-ca",
        cwd=d,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
        "-subj",
        "/CN=127.0.0.1",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.pem",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        cwd=d,
    )
    tls_port = free_port()
    server = RedisServer(
        tmp_path / "tls",
        extra_args=[
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            str(d / "srv.pem"),
            "--tls-key-file",
            str(d / "srv.key"),
            "--tls-ca-cert-file",
            str(d / "ca.pem"),
            "--tls-auth-clients",
            "no",
            "--requirepass",
            "s3cret",
        ],
    )
    try:
        server.start()
    except RuntimeError as e:  # a server built without TLS
        pytest.skip(f"redis-server cannot serve TLS here: {e}")
    try:
        yield tls_port, d
    finally:
        server.stop()


def test_tls_round_trip_and_a_foreign_ca_is_a_miss(make_manager, tls_server):
    port, pki = tls_server
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={pki / 'ca.pem'}"
    m = redis_manager(make_manager, url, redis_password="s3cret")
    stored(m, 0, 1)
    objs = m.batched_get([key(0), key(1)])
    for i, obj in enumerate(objs):
        check_obj(obj, i)
        obj.release()
    # the system's CAs do not know this server's certificate: it is refused, every call misses
    untrusted = redis_manager(make_manager, f"rediss://127.0.0.1:{port}/0", redis_password="s3cret")
    assert untrusted.get(key(0)) is None
    assert untrusted.stats.get("redis.errors") >= 1

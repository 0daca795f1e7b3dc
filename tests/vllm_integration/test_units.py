"""Fast tests of the integration's parts that need no running engine: slot mappings, plugin registration and the control channel."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from kvtier.vllm_integration.channel import (
    ChannelError,
    ControlClient,
    ControlServer,
    socket_path,
)
from kvtier.vllm_integration.messages import slot_mapping


def test_slot_mapping_marks_only_the_asked_tokens() -> None:
    slots = slot_mapping([7, 3, 9], 4, 12, 2, 9)
    expected = [-1, -1, 30, 31, 12, 13, 14, 15, 36, -1, -1, -1]
    assert slots.tolist() == expected
    with pytest.raises(ValueError, match="cannot hold"):
        slot_mapping([7], 4, 8, 0, 6)


def test_plugin_registration_is_idempotent() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtier.vllm_integration.plugin import register

    register()
    register()  # vLLM runs plugins in every process, sometimes twice: must not raise
    cls = KVConnectorFactory.get_connector_class_by_name("KVTierConnector")
    assert cls.__name__ == "KVTierConnector"
    assert cls.__module__ == "kvtier.vllm_integration.connector"


@pytest.fixture
def channel_path(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("KVTIER_RUNTIME_DIR", str(tmp_path))
    return socket_path("unit-test", 0)


def test_channel_round_trip_and_errors(channel_path: str) -> None:
    seen = []

    def handler(request):
        if request["op"] == "boom":
            raise RuntimeError("handler failed")
        seen.append(request)
        return {"stats": {"asked": len(seen)}}

    server = ControlServer(channel_path, handler)
    client = ControlClient(channel_path, timeout_s=2.0)
    try:
        assert client.call({"op": "stats", "x": [1, 2]}) == {"stats": {"asked": 1}}
        with pytest.raises(ChannelError, match="handler failed"):
            client.call({"op": "boom"})
        # the connection survives a handler error
        assert client.call({"op": "stats"}) == {"stats": {"asked": 2}}
        assert seen[0] == {"op": "stats", "x": [1, 2]}
    finally:
        client.close()
        server.close()
    with pytest.raises(ChannelError):
        ControlClient(channel_path, timeout_s=1.0).call({"op": "stats"})


def test_channel_is_bounded_when_the_worker_hangs(channel_path: str) -> None:
    release = threading.Event()

    def handler(request):
        release.wait(10)
        return {"flushed": True}

    server = ControlServer(channel_path, handler)
    try:
        t0 = time.monotonic()
        with pytest.raises(ChannelError):
            ControlClient(channel_path, timeout_s=0.3).call({"op": "flush"})
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
        server.close()


def test_channel_refuses_a_second_live_server_but_replaces_a_stale_socket(channel_path) -> None:
    server = ControlServer(channel_path, lambda r: {"stats": {"server": 1}})
    try:
        with pytest.raises(ChannelError, match="engine_id"):
            ControlServer(channel_path, lambda r: {"stats": {"server": 2}})
    finally:
        server.close()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(channel_path)  # bound, never listening: what a killed process leaves
    stale.close()
    server = ControlServer(channel_path, lambda r: {"stats": {"server": 3}})
    try:
        assert ControlClient(channel_path, 2.0).call({"op": "stats"})["stats"] == {"server": 3}
    finally:
        server.close()


def test_channel_drops_malformed_frames(channel_path: str) -> None:
    server = ControlServer(channel_path, lambda r: {"stats": {"ok": 1}})
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2)
            s.connect(channel_path)
            s.sendall((1 << 30).to_bytes(4, "big"))  # absurd header length
            assert s.recv(16) == b""  # the server hangs up instead of allocating it
        assert ControlClient(channel_path, 2.0).call({"op": "stats"})["stats"] == {"ok": 1}
    finally:
        server.close()

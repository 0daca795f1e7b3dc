"""``kvtier.vllm_integration.pd_proxy`` between two HTTP upstreams standing in for the prefill and decode
instances: the prefill instance is asked for one token without streaming, its
``kv_transfer_params`` go on to the decode instance with the original request, and the decode
instance's answer (streamed or not) comes back as it is. (The instances themselves, and kvtier's
announcement, are tested through real vLLM in test_e2e_handover.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from kvtier.vllm_integration.pd_proxy import build_app, decode_body, prefill_body  # noqa: E402

PARAMS = {"kvtier": {"stored_tokens": 64}}


def upstreams(seen: dict[str, list[dict]], status: int = 200):
    async def prefill(request: web.Request) -> web.Response:
        seen["prefill"].append(await request.json())
        if status != 200:
            return web.json_response({"error": "no"}, status=status)
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})

    async def decode(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen["decode"].append(body)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "hello world"}]})
        out = web.StreamResponse()
        out.content_type = "text/event-stream"
        await out.prepare(request)
        for piece in ("data: a\n\n", "data: b\n\n", "data: [DONE]\n\n"):
            await out.write(piece.encode())
        await out.write_eof()
        return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    apps = []
    for handler in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_get("/health", health)
        apps.append(app)
    return apps


async def through_proxy(body: dict, status: int = 200) -> tuple[int, bytes, dict]:
    seen: dict[str, list[dict]] = {"prefill": [], "decode": []}
    p_app, d_app = upstreams(seen, status)
    async with TestServer(p_app) as p, TestServer(d_app) as d:
        app = build_app(str(p.make_url("")).rstrip("/"), str(d.make_url("")).rstrip("/"))
        async with TestClient(TestServer(app)) as client:
            health = await client.get("/health")
            assert health.status == 200
            r = await client.post("/v1/completions", json=body)
            return r.status, await r.read(), seen


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_then_decode_with_the_announcement(stream) -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 32, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, data, seen = asyncio.run(through_proxy(body))
    assert status == 200
    (first,) = seen["prefill"]
    assert first["max_tokens"] == 1 and first["stream"] is False and "stream_options" not in first
    (second,) = seen["decode"]
    assert second == {**body, "kv_transfer_params": PARAMS}
    if stream:
        assert data == b"data: a\n\ndata: b\n\ndata: [DONE]\n\n"
    else:
        assert json.loads(data)["choices"][0]["text"] == "hello world"


def test_a_failed_prefill_is_the_answer() -> None:
    status, _, seen = asyncio.run(through_proxy({"prompt": "p", "max_tokens": 4}, status=500))
    assert status == 500 and not seen["decode"]


def test_bodies() -> None:
    body = {"prompt": "p", "max_tokens": 9, "min_tokens": 3, "max_completion_tokens": 9}
    assert prefill_body(body) == {"prompt": "p", "max_tokens": 1, "min_tokens": 0, "stream": False}
    assert body["max_tokens"] == 9, "the caller's body is not changed"
    assert decode_body(body, None) == body

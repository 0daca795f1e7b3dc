"""A prefill/decode proxy for kvtier (vLLM's disaggregated-serving proxy pattern).

Each completion request goes first to the prefill instance (``kv_role: kv_producer``) with
``max_tokens: 1`` and no streaming; its response carries the ``kv_transfer_params`` in which kvtier
announces what it stored in the shared tier (``kvtier.vllm_integration.handover``). The request
then goes to the decode instance (``kv_consumer``) with those parameters, and the decode
instance's response (streamed or not) is passed back as it comes. The decode instance waits,
bounded, for the announced chunks to be readable, so it loads them instead of computing them.

    kvtier-pd-proxy --prefill URL --decode URL [--port N]
    python -m kvtier.vllm_integration.pd_proxy ...   (the same)

``GET /health`` answers once both instances do.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

ROUTES = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 600.0  # one request end to end (a long prefill on a small CPU)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill instance is asked: the prompt, one token, no stream."""
    out = copy.deepcopy(body)
    out.update(max_tokens=1, stream=False)
    out.pop("stream_options", None)
    out.pop("max_completion_tokens", None)
    if "min_tokens" in out:
        out["min_tokens"] = 0
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """What the decode instance is asked: the original request and the prefill's
    ``kv_transfer_params`` (none when the prefill instance announced nothing)."""
    out = copy.deepcopy(body)
    if params:
        out["kv_transfer_params"] = params
    return out


def build_app(prefill: str, decode: str) -> Any:
    from aiohttp import ClientSession, ClientTimeout, web

    key = web.AppKey("session", ClientSession)

    async def start(app: web.Application) -> None:
        app[key] = ClientSession(timeout=ClientTimeout(total=TIMEOUT_S))

    async def stop(app: web.Application) -> None:
        await app[key].close()

    async def health(request: web.Request) -> web.Response:
        session = request.app[key]
        for url in (prefill, decode):
            async with session.get(url + "/health") as r:
                if r.status != 200:
                    return web.Response(status=503, text=f"{url} is not ready")
        return web.Response(text="ok")

    async def forward(request: web.Request) -> web.StreamResponse:
        session = request.app[key]
        body = await request.json()
        async with session.post(prefill + request.path, json=prefill_body(body)) as r:
            first = await r.read()
            if r.status != 200:
                return web.Response(status=r.status, body=first, content_type="application/json")
        params = json.loads(first).get("kv_transfer_params")
        async with session.post(decode + request.path, json=decode_body(body, params)) as r:
            out = web.StreamResponse(status=r.status)
            out.content_type = r.content_type
            await out.prepare(request)
            async for piece in r.content.iter_any():
                await out.write(piece)
            await out.write_eof()
            return out

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    for route in ROUTES:
        app.router.add_post(route, forward)
    return app


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", required=True, help="the prefill instance's base URL")
    p.add_argument("--decode", required=True, help="the decode instance's base URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    web.run_app(
        build_app(args.prefill.rstrip("/"), args.decode.rstrip("/")),
        host=args.host,
        port=args.port,
        print=None,
    )


if __name__ == "__main__":
    main()

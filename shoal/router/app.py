"""The router's HTTP app: /v1/completions and /v1/chat/completions proxied (streams pass
through as they come) to the backend the policy picks; /health, /v1/models and
/router/state (the index and loads, for operators and tests)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from shoal.kv_cache.events import BlockStored, KVEventBatch
from shoal.router import upstream
from shoal.router.passthrough import pass_through
from shoal.router.policy import Router
from shoal.router.subscriber import EventSubscriber

logger = logging.getLogger(__name__)

# Request headers passed to the backend (the rest are the router's own connection's).
_FORWARDED = ("authorization", "content-type", "accept", "x-request-id")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "router_error",
                                   "code": status}}, status_code=status)


def _subscribers(router: Router, ctx: zmq.asyncio.Context, topic: str) -> list[EventSubscriber]:
    subs = []
    for i, backend in enumerate(router.backends):
        def apply(batch: KVEventBatch, i: int = i) -> None:
            for ev in batch.events:  # the engines' block size, once known
                if isinstance(ev, BlockStored) and ev.block_size != router.block_size:
                    logger.info("backends use %d-token blocks", ev.block_size)
                    router.block_size = ev.block_size
            router.index.apply(i, batch.events)

        for endpoint, replay in zip(backend.kv_events, backend.replay):
            subs.append(EventSubscriber(ctx, endpoint, replay, apply,
                                        lambda i=i: router.index.clear(i), topic))
    return subs


def build_app(router: Router, topic: str = "") -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx = zmq.asyncio.Context()
        tasks = [asyncio.create_task(s.run()) for s in _subscribers(router, ctx, topic)]
        yield
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.destroy(linger=0)

    app = FastAPI(title="shoal router", lifespan=lifespan)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/router/state")
    async def state() -> JSONResponse:
        return JSONResponse(router.state())

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _proxy(router, request, "/v1/models", b"", 0, method="GET")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _route(router, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _route(router, request, "/v1/chat/completions")

    return app


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}


async def _route(router: Router, request: Request, path: str) -> Response:
    raw = await request.body()
    try:
        body: Any = json.loads(raw)
    except ValueError:
        return _error(400, "the request body is not JSON")
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object")
    prompt = await router.prompt(path, body, _headers(request))
    salt = body.get("cache_salt")
    hashes = (router.hashes(prompt, salt if isinstance(salt, str) else None)
              if prompt is not None and prompt.token_ids else [])
    target, hit = router.choose(hashes)
    logger.debug("%s: %d of %d blocks held by %s", path, hit, len(hashes),
                 router.backends[target].url)
    return await _proxy(router, request, path, raw, target, hit=hit)


async def _proxy(router: Router, request: Request, path: str, raw: bytes, target: int,
                 method: str = "POST", hit: int = 0) -> Response:
    backend = router.backends[target]
    backend.in_flight += 1
    backend.routed += 1
    backend.prefix_routed += hit > 0
    try:
        resp = await upstream.request(backend.url, method, path, raw, _headers(request),
                                      timeout=None)
    except upstream.UpstreamError as e:
        backend.in_flight -= 1
        return _error(502, str(e))

    def done() -> None:  # the backend's load drops whether the client stayed or left
        backend.in_flight -= 1

    return pass_through(resp, headers={"x-shoal-backend": backend.url}, on_done=done)

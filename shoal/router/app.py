"""The router's HTTP app: /v1/completions and /v1/chat/completions proxied (streams pass
through as they come) to the backend replica the policy picks (a data-parallel backend's
replica named in the X-data-parallel-rank header); /health, /v1/models and /router/state
(the index and loads, for operators and tests)."""

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
from shoal.router.policy import Router, Target
from shoal.router.subscriber import EventSubscriber

logger = logging.getLogger(__name__)

# Request headers passed to the backend (the rest are the router's own connection's; a
# client's X-data-parallel-rank among them: the router places requests itself).
_FORWARDED = ("authorization", "content-type", "accept", "x-request-id")
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's: run the request on this DP replica


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "router_error",
                                   "code": status}}, status_code=status)


def _learn_rank(router: Router, holder: tuple[int, int], endpoint: str,
                batch: KVEventBatch) -> None:
    """A data-parallel replica is named by the rank its events carry (expected: its
    endpoint's place in --kv-events)."""
    replica = router.replica(holder)
    rank = batch.data_parallel_rank
    if replica.rank is None or rank is None or rank == replica.rank:
        return
    logger.warning("KV events on %s come from data-parallel rank %d, not %d (its place in "
                   "--kv-events): requests for its blocks name rank %d", endpoint, rank,
                   replica.rank, rank)
    replica.rank = rank


def _subscribers(router: Router, ctx: zmq.asyncio.Context, topic: str) -> list[EventSubscriber]:
    subs = []
    for i, backend in enumerate(router.backends):
        for j, (endpoint, replay) in enumerate(zip(backend.kv_events, backend.replay)):
            def apply(batch: KVEventBatch, holder: tuple[int, int] = (i, j),
                      endpoint: str = endpoint) -> None:
                for ev in batch.events:  # the engines' block size, once known
                    if isinstance(ev, BlockStored) and ev.block_size != router.block_size:
                        logger.info("backends use %d-token blocks", ev.block_size)
                        router.block_size = ev.block_size
                _learn_rank(router, holder, endpoint, batch)
                router.index.apply(holder, batch.events)

            subs.append(EventSubscriber(ctx, endpoint, replay, apply,
                                        lambda h=(i, j): router.index.clear(h), topic))
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
        return await _proxy(router, request, "/v1/models", b"", Target(0), method="GET")

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
    target = router.choose(hashes)
    logger.debug("%s: %d of %d blocks held by %s replica %s", path, target.hit, len(hashes),
                 router.backends[target.backend].url, router.replica(target.holder).rank)
    return await _proxy(router, request, path, raw, target)


async def _proxy(router: Router, request: Request, path: str, raw: bytes, target: Target,
                 method: str = "POST") -> Response:
    url = router.backends[target.backend].url
    replica = router.replica(target.holder)
    headers, shown = _headers(request), {"x-shoal-backend": url}
    if replica.rank is not None:
        headers[DP_RANK_HEADER] = shown["x-shoal-replica"] = str(replica.rank)
    replica.in_flight += 1
    replica.routed += 1
    replica.prefix_routed += target.hit > 0
    try:
        resp = await upstream.request(url, method, path, raw, headers, timeout=None)
    except upstream.UpstreamError as e:
        replica.in_flight -= 1
        return _error(502, str(e))

    def done() -> None:  # the replica's load drops whether the client stayed or left
        replica.in_flight -= 1

    return pass_through(resp, headers=shown, on_done=done)

"""`shoal proxy --prefill URL... --decode URL...`: the OpenAI API in front of prefill and decode
engines (prefill/decode disaggregation, shoal/kv_transfer).

Each /v1/completions or /v1/chat/completions request goes to a prefill engine first, as is but
with max_tokens 1, no stream and kv_transfer_params {"do_remote_decode": true}: it computes
the prompt's KV and keeps it. Its answer's kv_transfer_params (where the KV waits) go with
the original request to a decode engine, which fetches the KV instead of computing the prompt
and streams the answer back through the proxy. A prefill engine that cannot be reached, or
fails, leaves the decode engine to compute the prompt itself; a request the prefill engine
refuses as bad (4xx) is answered with that refusal. Engines are taken in turn."""

from __future__ import annotations

import itertools
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from shoal.router import upstream
from shoal.router.passthrough import pass_through

logger = logging.getLogger(__name__)

_FORWARDED = ("authorization", "content-type", "accept", "x-request-id")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "proxy_error",
                                   "param": None, "code": status}}, status_code=status)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill engine runs it: one token, kept KV, one answer."""
    pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    pre["max_tokens"] = 1
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    pre["kv_transfer_params"] = {"do_remote_decode": True}
    return pre


class DisaggProxy:
    def __init__(self, prefill: list[str], decode: list[str]):
        if not prefill or not decode:
            raise ValueError("shoal proxy needs at least one --prefill and one --decode URL")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._next_prefill = itertools.cycle(range(len(self.prefill)))
        self._next_decode = itertools.cycle(range(len(self.decode)))
        self.num_prefilled = self.num_recomputed = 0

    async def prefill_params(self, path: str, body: dict[str, Any],
                             headers: dict[str, str]) -> dict[str, Any] | Response | None:
        """The KV's whereabouts from a prefill engine; None: the decode engine computes the
        prompt; a Response: the prefill engine's refusal of a bad request."""
        url = self.prefill[next(self._next_prefill)]
        try:
            resp = await upstream.request(url, "POST", path, json.dumps(prefill_body(body))
                                          .encode(), headers, timeout=None)
            raw = await resp.read_all()
        except upstream.UpstreamError as e:
            logger.warning("prefill engine %s failed (%s): the decode engine computes", url, e)
            return None
        if 400 <= resp.status < 500:
            return Response(raw, status_code=resp.status, media_type="application/json")
        try:
            params = json.loads(raw).get("kv_transfer_params") if resp.status == 200 else None
        except ValueError:
            params = None
        return params if isinstance(params, dict) else None

    async def handle(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body: Any = json.loads(raw)
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
        params = await self.prefill_params(path, body, headers)
        if isinstance(params, Response):
            return params
        if params is None:
            self.num_recomputed += 1
        else:
            self.num_prefilled += 1
            body = {**body, "kv_transfer_params": params}
        url = self.decode[next(self._next_decode)]
        try:
            resp = await upstream.request(url, "POST", path, json.dumps(body).encode(),
                                          headers, timeout=None)
        except upstream.UpstreamError as e:
            return _error(502, str(e))

        return pass_through(resp)


def build_app(proxy: DisaggProxy) -> FastAPI:
    app = FastAPI(title="shoal proxy")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/proxy/state")
    async def state() -> JSONResponse:
        return JSONResponse({"prefill": proxy.prefill, "decode": proxy.decode,
                             "prefilled": proxy.num_prefilled,
                             "recomputed": proxy.num_recomputed})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        resp = await upstream.request(proxy.decode[0], "GET", "/v1/models")
        return Response(await resp.read_all(), status_code=resp.status,
                        media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    return app

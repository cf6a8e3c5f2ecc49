"""The request size middleware (shoal/entrypoints/openai/limits.py) on a small app with the
server's error handlers: oversized bodies (declared or streamed) are 413 and oversized headers
431, with OpenAI error bodies, before the handler does any work."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request

from shoal.entrypoints.openai.errors import install_error_handlers
from shoal.entrypoints.openai.limits import RequestSizeLimitMiddleware

LIMIT = 1000


def _app() -> tuple[FastAPI, list[int]]:
    app = FastAPI()
    install_error_handlers(app)
    seen: list[int] = []

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        seen.append(len(body))
        return {"n": len(body)}

    app.add_middleware(RequestSizeLimitMiddleware, max_body_bytes=LIMIT)
    return app, seen


def _post(app: FastAPI, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/echo", **kw)
    return asyncio.run(go())


def _is_openai_error(resp: httpx.Response, status: int) -> bool:
    err = resp.json()["error"]
    return resp.status_code == status and err["code"] == status and err["message"]


def test_bodies_within_the_limit_pass():
    app, seen = _app()
    assert _post(app, content=b"x" * LIMIT).json() == {"n": LIMIT}
    assert seen == [LIMIT]


def test_a_declared_oversized_body_is_413_before_the_handler():
    app, seen = _app()
    resp = _post(app, content=b"x" * (LIMIT + 1))
    assert _is_openai_error(resp, 413) and "max-request-body-bytes" in resp.json()["error"][
        "message"]
    assert seen == []


def test_a_streamed_oversized_body_is_413_while_it_is_read():
    app, seen = _app()

    async def chunks():
        for _ in range(10):
            yield b"x" * 300

    resp = _post(app, content=chunks())  # no Content-Length: chunked
    assert _is_openai_error(resp, 413) and seen == []


def test_oversized_headers_are_431_and_a_bad_length_400():
    app, seen = _app()
    assert _is_openai_error(_post(app, content=b"{}", headers={"x-big": "y" * 70_000}), 431)
    assert _is_openai_error(_post(app, content=b"{}", headers={"content-length": "lots"}), 400)
    assert seen == []

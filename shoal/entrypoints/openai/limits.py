"""Request size limits, as pure ASGI middleware (streamed responses pass untouched).

A body larger than --max-request-body-bytes is answered 413 before the handler runs when
Content-Length says so, and otherwise (chunked uploads, a Content-Length that lies) as soon as
the bytes read pass the limit: the handler's read of the body raises. Headers totalling more
than MAX_HEADER_BYTES are answered 431. Both with an OpenAI error body."""

from __future__ import annotations

import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.entrypoints.openai.errors import error_body

# Every header of a request, names and values: far above what any client sends.
MAX_HEADER_BYTES = 64 << 10


class BodyTooLarge(HTTPException):
    """Raised from `receive` when a streamed body passes the limit (FastAPI re-raises
    HTTPException while reading a body, so the app's handler answers it)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes "
                              "(--max-request-body-bytes)")


class RequestSizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int,
                 max_header_bytes: int = MAX_HEADER_BYTES):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        if sum(len(k) + len(v) for k, v in headers) > self.max_header_bytes:
            await _answer(send, 431, f"the request headers are larger than "
                                     f"{self.max_header_bytes} bytes")
            return
        length = _content_length(headers)
        if length is None:
            await _answer(send, 400, "invalid Content-Length header")
            return
        if length > self.max_body_bytes:
            await _answer(send, 413, BodyTooLarge(self.max_body_bytes).detail)
            return
        await self._limited(scope, receive, send)

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as e:  # a handler that read the body itself and did not catch it
            if started:
                raise
            await _answer(send, 413, str(e.detail))


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The declared body length (0 when absent); None when the header is not a number."""
    for k, v in headers:
        if k.lower() == b"content-length":
            try:
                n = int(v)
            except ValueError:
                return None
            return n if n >= 0 else None
    return 0


async def _answer(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})

"""Optional pure-ASGI middleware (streams pass untouched): X-Request-Id headers and the
server-load count behind GET /load."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.entrypoints.openai.auth import route_path

# The routes that run the model, counted by --enable-server-load-tracking (as vLLM's /load).
LOAD_TRACKED_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses",
    "/invocations",
})


class RootPathMiddleware:
    """--root-path: the prefix a proxy may leave on paths. Routing strips it from a path that
    has it (Starlette's root_path rule), so routes answer with and without it."""

    def __init__(self, app: ASGIApp, root_path: str):
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """--enable-request-id-headers: echoes the client's X-Request-Id, else sends a new one."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        value = rid or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", value)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class ServerLoad:
    """The number of model-running requests in flight (a whole stream counts until its last
    byte is sent)."""

    def __init__(self) -> None:
        self.value = 0


class ServerLoadMiddleware:
    def __init__(self, app: ASGIApp, load: ServerLoad):
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in LOAD_TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.value -= 1

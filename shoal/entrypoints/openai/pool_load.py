"""GET /load (--enable-server-load-tracking) over every API process of `shoal serve
--api-server-count N`: vLLM's meaning, the number of model-running requests in flight on the
server, whichever process a client asks.

Each API process counts its own requests in its cell of the pool's shared counters (as
middleware.ServerLoadMiddleware counts them in one process: the same paths, a whole stream until
its last byte). /load is still answered by the app's route (its headers, X-Request-Id
included), with the sum of all cells in place of the process's own count. A process that dies
takes its requests with it: the supervisor zeroes its cell (PoolShared.process_gone) before
it starts a new process on the same index, which counts up from 0.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.entrypoints.openai.auth import route_path
from shoal.entrypoints.openai.middleware import LOAD_TRACKED_PATHS
from shoal.entrypoints.openai.pool_state import PoolShared


class SharedServerLoad:
    """Pure ASGI middleware, outside the app's own (which counts this process alone)."""

    def __init__(self, app: ASGIApp, shared: PoolShared, index: int):
        self.app = app
        self.shared = shared
        self.cells = shared.cells
        self.index = index
        self.root_path = shared.root_path

    def _path(self, scope: Scope) -> str:
        # RootPathMiddleware sets root_path further in; strip --root-path as the routes will.
        if self.root_path:
            scope = {**scope, "root_path": self.root_path}
        return route_path(scope)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = self._path(scope)
        if path == "/load" and scope["method"] == "GET":
            await self.app(scope, receive, self._server_total(send))
            return
        if path not in LOAD_TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.cells[self.index] += 1  # (this process's cell: no other writer)
        try:
            await self.app(scope, receive, send)
        finally:
            self.cells[self.index] -= 1

    def _server_total(self, send: Send) -> Send:
        """`send`, with the body of the route's answer (one JSON message) replaced."""
        held: list[Message] = []

        async def total(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 200:
                held.append(message)  # (its content-length changes with the body)
                return
            if held and message["type"] == "http.response.body":
                body = json.dumps({"server_load": self.shared.requests_in_flight()},
                                  separators=(",", ":")).encode()  # (as JSONResponse writes)
                start = held.pop()
                headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
                await send({**start, "headers": [*headers,
                                                 (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        return total

"""API-key check for every route except /health (pure ASGI, so streams pass untouched)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from shoal.entrypoints.openai.errors import error_response

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        # Constant-time comparison: the time taken must not reveal how much of a key matched.
        if not hmac.compare_digest(given, self.expected):
            message = ("missing API key: pass it as 'Authorization: Bearer <key>'" if not given
                       else "invalid API key")
            response = error_response(401, message, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

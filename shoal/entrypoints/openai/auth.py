"""API-key check (pure ASGI, so streams pass untouched).

With --api-key, every route that runs the model or the tokenizer needs the key: /v1/*,
/tokenize, /detokenize, /tokenizer_info, /invocations, and any route added later (the check
is by exclusion, and unknown paths need the key too, so a probe learns nothing). Only the
probes and scrape targets a load balancer or Prometheus hits without credentials are open."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from shoal.entrypoints.openai.errors import error_response

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/load"})


def route_path(scope: Scope) -> str:
    """The path routes are matched on: without the --root-path prefix, when it has one."""
    path = scope["path"]
    root = scope.get("root_path") or ""
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"
                or route_path(scope) in OPEN_PATHS):
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

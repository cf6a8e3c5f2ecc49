"""A backend's response handed to the client as it arrives: status, content type and body
chunks (so streamed completions pass through event by event), for the router and the
disaggregation proxy alike."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from shoal.router.upstream import UpstreamResponse


def pass_through(resp: UpstreamResponse, headers: dict[str, str] | None = None,
                 on_done: Callable[[], None] | None = None) -> StreamingResponse:
    """`on_done` runs once the body has been sent or the client went away."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for part in resp.body():
                yield part
        finally:
            if on_done is not None:
                on_done()
            resp.close()

    return StreamingResponse(body(), status_code=resp.status, headers=headers,
                             media_type=resp.headers.get("content-type", "application/json"))

"""Server-Sent Events and client-disconnect handling.

A client that hangs up must free its KV blocks at once. For streams, Starlette cancels the
response task on `http.disconnect` (ASGI spec < 2.4, which uvicorn speaks), which raises
CancelledError inside our generator, whose `finally:` aborts the request. For plain requests
nothing cancels the handler, so `cancel_on_disconnect` watches `receive()` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from pydantic import BaseModel

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
_JSON = msgspec.json.Encoder()


class ClientDisconnected(Exception):
    pass


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else _dumps(payload)
    return f"data: {data}\n\n"


def _dumps(payload: dict[str, Any]) -> str:
    # msgspec: several times faster than json.dumps, and this runs once per streamed token.
    return _JSON.encode(payload).decode()


def abort_choices(indices: Iterable[int], finished: set[int],
                  chunk: Callable[[int], dict[str, Any]]) -> list[str]:
    """Closing events for the choices a failed stream leaves open (finish_reason "abort"),
    sent before its error event, so a client sees every choice end."""
    return [sse(chunk(i)) for i in indices if i not in finished]


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read already, so the next message is http.disconnect (uvicorn sends it
    # when the peer closes, or once our response is complete).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def output_batches(streams: list[Any]) -> AsyncIterator[list[tuple[int, Any]]]:
    """The outputs of one or more RequestStreams, tagged with the stream's index, in batches of
    whatever has arrived: a client that falls behind gets several chunks in one write (each
    still its own SSE event) instead of one write per token."""
    if len(streams) > 1:  # several prompts in one request (rare): one output at a time
        async for item in merge_streams(streams):
            yield [item]
        return
    while True:
        outs = await streams[0].drain()
        if not outs:
            return
        yield [(0, o) for o in outs]


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                queue.put_nowait((i, item, None, False))
        except Exception as e:
            queue.put_nowait((i, None, e, False))
        finally:
            queue.put_nowait((i, None, None, True))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, err, end = await queue.get()
            if err is not None:
                raise err
            if end:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def wait_grammar_checked(streams: list[Any]) -> None:
    """Before a stream of a constrained request starts (status 200), waits for each of its
    first outputs: a grammar the engine cannot compile is then a 400, as vLLM answers it. On
    any error every stream is aborted."""
    try:
        for s in streams:
            await s.wait_first()
    except BaseException:
        for s in streams:
            s.abort()
        raise

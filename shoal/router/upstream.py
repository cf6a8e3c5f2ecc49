"""The router's HTTP/1.1 client: one connection per request (Connection: close), the
response head first, then its body as it arrives (chunked, Content-Length or until close),
so streamed completions pass through event by event. Standard library only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

READ_SIZE = 65536
CONNECT_TIMEOUT_S = 10.0


class UpstreamError(Exception):
    """The backend could not be reached or answered with something that is not HTTP."""


@dataclass
class UpstreamResponse:
    status: int
    headers: dict[str, str]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    _closed: bool = field(default=False)

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they come; closes the connection when done or dropped."""
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                async for part in self._chunks():
                    yield part
            elif "content-length" in self.headers:
                left = int(self.headers["content-length"])
                while left > 0:
                    part = await self.reader.read(min(left, READ_SIZE))
                    if not part:
                        break
                    left -= len(part)
                    yield part
            else:
                while part := await self.reader.read(READ_SIZE):
                    yield part
        finally:
            self.close()

    async def read_all(self) -> bytes:
        return b"".join([part async for part in self.body()])

    async def _chunks(self) -> AsyncIterator[bytes]:
        while True:
            size = int((await self.reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            part = await self.reader.readexactly(size)
            await self.reader.readexactly(2)  # the CRLF after each chunk
            yield part

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.writer.close()


async def request(base_url: str, method: str, path: str, body: bytes = b"",
                  headers: dict[str, str] | None = None,
                  timeout: float | None = 30.0) -> UpstreamResponse:
    """Sends one request and reads the response head (within `timeout`; None: no limit,
    as a whole completion comes before its head)."""
    url = urlsplit(base_url)
    if url.scheme not in ("http", ""):
        raise UpstreamError(f"only http:// backends are supported (got {base_url!r})")
    host, port = url.hostname or "127.0.0.1", url.port or 80
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=2**20), CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError) as e:
        raise UpstreamError(f"cannot reach {base_url}: {e!r}") from None
    head = [f"{method} {url.path.rstrip('/')}{path} HTTP/1.1", f"Host: {host}:{port}",
            f"Content-Length: {len(body)}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
    try:
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        writer.close()
        raise UpstreamError(f"no response from {base_url}: {e!r}") from None
    lines = raw.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        writer.close()
        raise UpstreamError(f"bad status line from {base_url}: {lines[0]!r}") from None
    fields = {}
    for line in lines[1:]:
        if ":" in line:
            k, _, v = line.partition(":")
            fields[k.strip().lower()] = v.strip()
    return UpstreamResponse(status, fields, reader, writer)

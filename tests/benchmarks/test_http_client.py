"""The load generator's HTTP/1.1 client: response parsing split at every byte, keep-alive."""

from __future__ import annotations

import asyncio

import pytest

from shoal.benchmarks.http_client import HTTPClient, _Connection


class _Transport:
    def __init__(self):
        self.written = b""
        self.closed = False

    def write(self, data):
        self.written += data

    def close(self):
        self.closed = True


def _feed(raw: bytes, step: int) -> tuple[int, bytes, bool]:
    async def go():
        conn = _Connection()
        conn.transport = _Transport()
        got: list[bytes] = []
        done = conn.start(b"GET / HTTP/1.1\r\n\r\n", lambda b, _t: got.append(b))
        for i in range(0, len(raw), step):
            conn.data_received(raw[i:i + step])
        assert done.done()
        return done.result().status, b"".join(got), conn.keep_alive
    return asyncio.run(go())


CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n"
           b"8\r\ndata: 1\n\r\n"
           b"b;ext=1\r\n\ndata: 22\n\n\r\n"
           b"0\r\nx-trailer: y\r\n\r\n")


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_chunked_body_in_any_split(step):
    status, body, keep = _feed(CHUNKED, step)
    assert (status, body, keep) == (200, b"data: 1\n\ndata: 22\n\n", True)


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_content_length_body_and_connection_close(step):
    raw = b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\nConnection: close\r\n\r\nnope!"
    assert _feed(raw, step) == (404, b"nope!", False)


def test_keep_alive_reuses_one_connection(fake_server):
    async def go():
        client = HTTPClient(fake_server.base_url)
        for _ in range(5):
            resp, body = await client.get_bytes("/v1/models")
            assert resp.status == 200 and b"fake-model" in body
        n_idle = len(client._idle)
        resp, _ = await client.get_bytes("/nowhere")
        await client.close()
        return n_idle, resp.status

    assert asyncio.run(go()) == (1, 404)


def test_connection_refused_raises():
    async def go():
        client = HTTPClient("http://127.0.0.1:9")  # discard port: nothing listens
        await client.get_bytes("/")

    with pytest.raises(OSError):
        asyncio.run(go())

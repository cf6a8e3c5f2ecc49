"""A fake OpenAI-compatible server for measuring the load generator itself (no model).

It answers /v1/completions and /v1/chat/completions with exactly `max_tokens` tokens (the
usage it reports says so), streamed as one SSE event per token or as one JSON body, after an
optional `--ttft-ms` and with an optional `--itl-ms` between tokens. With both at 0 it streams
as fast as it can: each stream writes one event and then yields, so 256 concurrent streams
get their events interleaved one at a time, as from an engine step, rather than in one block.

Plain asyncio, no framework, so the server costs little next to the client it measures;
`--num-workers N` runs N processes on one port (SO_REUSEPORT) when one core is not enough.

    python -m shoal.benchmarks.fake_server --port 8100 [--ttft-ms 0 --itl-ms 0 --num-workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

MODEL = "fake-model"
TOKEN_TEXT = " tok"


@dataclass(frozen=True)
class FakeTiming:
    ttft_s: float = 0.0
    itl_s: float = 0.0


def _chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk of the chunked transfer encoding."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse(obj: dict) -> bytes:
    return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def _prompt_tokens(body: dict) -> int:
    """Token ids count as themselves; text counts one token per whitespace-separated word."""
    prompt = body.get("prompt")
    if prompt is None:
        text = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        return len(text.split())
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(str(p).split()) for p in prompt)
    return len(str(prompt).split())


def _headers(status: str, content_type: str, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n{extra}"
            "connection: keep-alive\r\n\r\n").encode()


def _json_response(obj: dict, status: str = "200 OK") -> bytes:
    body = json.dumps(obj).encode()
    return _headers(status, "application/json", f"content-length: {len(body)}\r\n") + body


async def _generate(writer: asyncio.StreamWriter, path: str, body: dict,
                    timing: FakeTiming) -> None:
    chat = path.endswith("/chat/completions")
    n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
    model = body.get("model") or MODEL
    usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": n,
             "total_tokens": _prompt_tokens(body) + n}
    rid, created = f"fake-{time.monotonic_ns()}", int(time.time())
    obj_name = "chat.completion" if chat else "text_completion"
    if not body.get("stream"):
        await asyncio.sleep(timing.ttft_s + timing.itl_s * max(n - 1, 0))
        choice: dict = ({"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": TOKEN_TEXT * n}}
                        if chat else
                        {"index": 0, "finish_reason": "length", "text": TOKEN_TEXT * n})
        writer.write(_json_response({"id": rid, "object": obj_name, "created": created,
                                     "model": model, "choices": [choice], "usage": usage}))
        await writer.drain()
        return
    chunk_name = "chat.completion.chunk" if chat else "text_completion"
    delta = ({"index": 0, "delta": {"content": TOKEN_TEXT}, "finish_reason": None}
             if chat else {"index": 0, "text": TOKEN_TEXT, "finish_reason": None})
    event = _sse({"id": rid, "object": chunk_name, "created": created, "model": model,
                  "choices": [delta]})
    writer.write(_headers("200 OK", "text/event-stream", "transfer-encoding: chunked\r\n"))
    if timing.ttft_s:
        await asyncio.sleep(timing.ttft_s)
    for i in range(n):
        if i:
            # Yield between tokens even at itl 0, so concurrent streams interleave.
            await asyncio.sleep(timing.itl_s)
        writer.write(event)
        if writer.transport.get_write_buffer_size() > 1 << 16:
            await writer.drain()
    tail = b""
    if (body.get("stream_options") or {}).get("include_usage"):
        tail += _sse({"id": rid, "object": chunk_name, "created": created, "model": model,
                      "choices": [], "usage": usage})
    writer.write(tail + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  timing: FakeTiming) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            raw = await reader.readexactly(length) if length else b""
            path = path.split("?", 1)[0]
            if method == "GET" and path == "/v1/models":
                writer.write(_json_response({"object": "list", "data": [
                    {"id": MODEL, "object": "model", "root": MODEL, "owned_by": "fake"}]}))
            elif method == "GET" and path == "/health":
                writer.write(_json_response({}))
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                await _generate(writer, path, json.loads(raw), timing)
            else:
                writer.write(_json_response({"error": {"message": f"no route {path}"}},
                                            "404 Not Found"))
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def make_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
    return sock


async def serve(sock: socket.socket, timing: FakeTiming) -> None:
    server = await asyncio.start_server(lambda r, w: _handle(r, w, timing), sock=sock,
                                        limit=1 << 20)
    async with server:
        await server.serve_forever()


def _worker(host: str, port: int, timing: FakeTiming) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us with SIGTERM
    try:
        asyncio.run(serve(make_socket(host, port), timing))
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    p.add_argument("--itl-ms", type=float, default=0.0, help="delay between tokens")
    p.add_argument("--num-workers", type=int, default=1, help="server processes on one port")
    ns = p.parse_args(argv)
    timing = FakeTiming(ns.ttft_ms / 1000, ns.itl_ms / 1000)
    if ns.num_workers <= 1:
        try:
            asyncio.run(serve(make_socket(ns.host, ns.port), timing))
        except KeyboardInterrupt:
            pass
        return 0
    procs = [mp.get_context("fork").Process(target=_worker, args=(ns.host, ns.port, timing),
                                            daemon=True) for _ in range(ns.num_workers)]
    for proc in procs:
        proc.start()
    print(f"fake server: {ns.num_workers} workers on {ns.host}:{ns.port} (pid {os.getpid()})",
          flush=True)
    stop = signal.sigwait if hasattr(signal, "sigwait") else None
    try:
        if stop is not None:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            stop({signal.SIGINT, signal.SIGTERM})
        else:  # pragma: no cover
            for proc in procs:
                proc.join()
    finally:
        for proc in procs:
            proc.terminate()
            proc.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())

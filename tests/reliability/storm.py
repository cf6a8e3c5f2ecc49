"""Concurrent streaming clients over raw sockets, some hanging up at random moments (issue 18,
item 2). Shared by test_load_and_disconnects.py and benchmarks/reliability_cpu.py."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field


@dataclass
class StreamResult:
    hang_up_after: int | None  # events read before hanging up; None: reads to the end
    status: int = 0
    events: int = 0
    completion_tokens: int | None = None
    finish_reasons: list[str] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]
    error: str | None = None


def _request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


def _parse_events(res: StreamResult, lines: list[bytes]) -> None:
    for line in lines:
        if res.hang_up_after is not None and res.events >= res.hang_up_after:
            return  # what came after the hang-up is not read
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            res.done = True
            continue
        res.events += 1
        msg = json.loads(payload)
        if msg.get("error"):
            res.error = str(msg["error"].get("message"))
        for choice in msg.get("choices") or []:
            if choice.get("finish_reason"):
                res.finish_reasons.append(choice["finish_reason"])
        if msg.get("usage"):
            res.completion_tokens = msg["usage"]["completion_tokens"]


async def stream_one(host: str, port: int, body: dict, hang_up_after: int | None,
                     path: str = "/v1/completions") -> StreamResult:
    res = StreamResult(hang_up_after)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_request(path, body))
        await writer.drain()
        if hang_up_after == 0:
            return res  # hangs up before a byte of the answer
        head = await reader.readuntil(b"\r\n\r\n")
        res.status = int(head.split(b" ", 2)[1])
        buf = b""
        while not res.done:
            chunk = await reader.read(65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            _parse_events(res, [ln.rstrip(b"\r") for ln in lines])
            if hang_up_after is not None and res.events >= hang_up_after:
                return res
    finally:
        writer.transport.abort()  # a hang-up: no FIN handshake, like a killed client
    return res


async def storm(host: str, port: int, clients: int, hang_up_fraction: float, max_tokens: int,
                seed: int) -> list[StreamResult]:
    """`clients` streams at once; a random `hang_up_fraction` of them hang up after a random
    number of events (0: right after sending the request)."""
    rng = random.Random(seed)
    body = {"prompt": "hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    plans = [rng.randrange(0, max_tokens) if rng.random() < hang_up_fraction else None
             for _ in range(clients)]
    return await asyncio.gather(*(stream_one(host, port, body, p) for p in plans))

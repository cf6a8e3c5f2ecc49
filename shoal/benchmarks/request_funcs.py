"""One benchmark request against an OpenAI-compatible endpoint, timed as vLLM's client does.

Streaming: TTFT is the time to the first event that carries a choice, each later such event
adds one inter-token latency (ITL; an event may carry several tokens when a server
coalesces), and the end-to-end latency ends at the last such event. Output tokens come from
the final usage event (`stream_options.include_usage`); without one they are counted by
the tokenizer, or else as the number of events. Non-streaming (`stream=False`, shoal's
addition for W8): one JSON answer, so TTFT = end-to-end latency and there are no ITLs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.benchmarks.http_client import HTTPClient

try:  # msgspec (a shoal dependency) decodes about twice as fast as json
    from msgspec.json import decode as _decode
except ImportError:  # pragma: no cover
    _decode = json.loads

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RequestInput:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    model: str
    endpoint: str = "/v1/completions"
    stream: bool = True
    ignore_eos: bool = False
    extra_body: dict[str, Any] | None = None
    request_id: str | None = None


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int = 0  # from the server's usage; 0 when it sent none
    chunks: int = 0  # events that carried a choice
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # perf_counter() when the request was sent
    client_queue_time: float = 0.0  # waiting for a --max-concurrency slot


def build_body(inp: RequestInput) -> bytes:
    chat = inp.endpoint.endswith("chat/completions")
    body: dict[str, Any] = {"model": inp.model}
    if chat:
        if not isinstance(inp.prompt, str):
            raise ValueError("the chat endpoint needs text prompts (not --token-id-prompts)")
        body["messages"] = [{"role": "user", "content": inp.prompt}]
        body["max_completion_tokens"] = inp.output_len
    else:
        body["prompt"] = inp.prompt
        body["max_tokens"] = inp.output_len
    body["stream"] = inp.stream
    if inp.stream:
        body["stream_options"] = {"include_usage": True}
    if inp.ignore_eos:
        body["ignore_eos"] = True
    if inp.extra_body:
        body.update(inp.extra_body)
    return json.dumps(body, separators=(",", ":")).encode()


class _StreamTimer:
    """Splits SSE bytes into events and times the ones that carry a choice."""

    def __init__(self, out: RequestOutput, chat: bool) -> None:
        self.out = out
        self.chat = chat
        self.pending = b""
        self.last = 0.0
        self.texts: list[str] = []
        self.error: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        if self.pending:
            data = self.pending + data
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        events = data.split(b"\n\n")
        self.pending = events.pop()
        for event in events:
            if event:
                self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        if event.startswith(b"data: "):
            payload = event[6:]
        else:  # comments (":ping"), multi-line data, other fields
            lines = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if not lines:
                return
            payload = b"\n".join(lines)
        if payload == b"[DONE]":
            return
        try:
            obj = _decode(payload)
        except Exception:  # not JSON: an error page, or a broken stream
            self.error = f"not a JSON event: {payload[:200]!r}"
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj and obj["error"]:
            err = obj["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        choices = obj.get("choices")
        if choices:
            out = self.out
            if out.chunks == 0:
                out.ttft = now - out.start_time
            else:
                out.itl.append(now - self.last)
            self.last = now
            out.chunks += 1
            choice = choices[0]
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if text:
                self.texts.append(text)
        usage = obj.get("usage")
        if usage:
            self.out.output_tokens = usage.get("completion_tokens") or 0
            if usage.get("prompt_tokens") is not None:
                self.out.prompt_len = usage["prompt_tokens"]


async def send_request(client: HTTPClient, inp: RequestInput,
                       on_done: Callable[[], None] | None = None) -> RequestOutput:
    out = RequestOutput(prompt_len=inp.prompt_len)
    chat = inp.endpoint.endswith("chat/completions")
    body = build_body(inp)
    headers = {"X-Request-Id": inp.request_id} if inp.request_id else None
    out.start_time = time.perf_counter()
    try:
        if inp.stream:
            timer = _StreamTimer(out, chat)
            head: list[bytes] = []  # the first reads, for the message of an error response

            def sink(data: bytes, now: float) -> None:
                if len(head) < 4:
                    head.append(data)
                timer.feed(data, now)

            resp = await client.request("POST", inp.endpoint, body, sink, headers=headers)
            if resp.status != 200:
                text = b"".join(head)[:300].decode(errors="replace")
                out.error = f"HTTP {resp.status} {resp.reason}: {text}"
            elif timer.error is not None:
                out.error = timer.error
            elif out.chunks == 0:
                out.error = "no token was streamed"
            else:
                out.success = True
                out.latency = timer.last - out.start_time
                out.generated_text = "".join(timer.texts)
        else:
            parts: list[bytes] = []
            arrived = [0.0]

            def collect(data: bytes, now: float) -> None:
                parts.append(data)
                arrived[0] = now

            resp = await client.request("POST", inp.endpoint, body, collect, headers=headers)
            now = arrived[0] or time.perf_counter()
            try:
                obj = _decode(b"".join(parts)) if parts else {}
            except Exception:
                obj = {"error": {"message": b"".join(parts)[:300].decode(errors="replace")}}
                if resp.status == 200:
                    raise
            if resp.status != 200:
                message = obj.get("error", {}) if isinstance(obj, dict) else {}
                message = message.get("message", "") if isinstance(message, dict) else ""
                out.error = f"HTTP {resp.status} {resp.reason} {message}".strip()
            else:
                out.success = True
                out.latency = out.ttft = now - out.start_time
                out.chunks = 1
                choice = (obj.get("choices") or [{}])[0]
                out.generated_text = ((choice.get("message") or {}).get("content") or ""
                                      if chat else choice.get("text") or "")
                usage = obj.get("usage") or {}
                out.output_tokens = usage.get("completion_tokens") or 0
                if usage.get("prompt_tokens") is not None:
                    out.prompt_len = usage["prompt_tokens"]
    except Exception as e:  # a failed request is a result, not a crash
        out.success = False
        out.error = f"{type(e).__name__}: {e}"
    if on_done is not None:
        on_done()
    return out

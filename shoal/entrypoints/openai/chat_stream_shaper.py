"""The delta of a streamed chat choice when its text is not plain content: reasoning split off
(--reasoning-parser) and tool calls sent as OpenAI sends them (`delta.tool_calls` entries with
an index; the first of a call carries its id, type and name, later ones argument text).

A named function streams its arguments as they are generated; a "required" call is sent
whole as soon as its object in the constrained array has closed; "auto" calls are sent once
the answer is complete (the content before them streams as it comes; text that may begin a
call is held back)."""

from __future__ import annotations

import json
from typing import Any

from shoal.entrypoints.openai.tool_choice import ToolPlan
from shoal.structured_output.reasoning_parsers import ReasoningParser, ReasoningStream
from shoal.structured_output.tool_parsers import ToolCall, tool_call_id


class ChoiceShaper:
    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None):
        self.plan = plan
        self._reasoning: ReasoningStream | None = reasoning.streamer() if reasoning else None
        self._buffer = ""  # content text held for tool parsing
        self._sent = 0  # characters of _buffer sent as content
        self._named_id: str | None = None
        self.calls_sent = 0

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """The delta fields for this much more text (empty when nothing is certain yet)."""
        delta: dict[str, Any] = {}
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text, final)
            if reasoning:
                delta["reasoning_content"] = reasoning
        mode = self.plan.mode
        if mode == "none":
            if text:
                delta["content"] = text
        elif mode == "named":
            self._named(text, final, delta)
        else:
            self._buffer += text
            if mode == "auto":
                self._auto(final, delta)
            else:
                self._required(final, delta)
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when an auto or required answer made calls; a named call
        ends with "stop"."""
        if reason == "stop" and self.calls_sent and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def _named(self, text: str, final: bool, delta: dict[str, Any]) -> None:
        if self._named_id is None:
            if not text and not final:
                return
            self._named_id = tool_call_id()
            self.calls_sent = 1
            delta["tool_calls"] = [{"index": 0, "id": self._named_id, "type": "function",
                                    "function": {"name": self.plan.name, "arguments": text}}]
        elif text:
            delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]

    def _auto(self, final: bool, delta: dict[str, Any]) -> None:
        assert self.plan.parser is not None
        if final:
            self._send_calls(delta)
            return
        start = self.plan.parser.start_index(self._buffer)
        safe = len(self._buffer) if start is None else start
        if safe > self._sent:
            delta["content"] = self._buffer[self._sent:safe]
            self._sent = safe

    def _required(self, final: bool, delta: dict[str, Any]) -> None:
        """Each call of the constrained JSON array is sent once its object has closed."""
        done = complete_array_items(self._buffer)
        calls = [ToolCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False))
                 for i in done[self.calls_sent:]
                 if isinstance(i, dict) and isinstance(i.get("name"), str)]
        if calls:
            delta["tool_calls"] = [_call_delta(self.calls_sent + j, c)
                                   for j, c in enumerate(calls)]
            self.calls_sent += len(calls)
        if final and not self.calls_sent and self._buffer:
            delta["content"] = self._buffer  # cut off before a call was complete

    def _send_calls(self, delta: dict[str, Any]) -> None:
        content, calls = self.plan.calls_from_text(self._buffer)
        rest = (content or "")[self._sent:] if calls else self._buffer[self._sent:]
        self._sent = len(self._buffer)
        if rest:
            delta["content"] = rest
        if calls:
            delta["tool_calls"] = [_call_delta(i, c) for i, c in enumerate(calls)]
            self.calls_sent = len(calls)


def complete_array_items(text: str) -> list[Any]:
    """The items of a JSON array that are complete in a partial text ('[{...}, {..')."""
    body = text.lstrip()
    if not body.startswith("["):
        return []
    decoder = json.JSONDecoder()
    items, i = [], 1
    while True:
        while i < len(body) and body[i] in " \t\n\r,":
            i += 1
        if i >= len(body) or body[i] == "]":
            return items
        try:
            item, i = decoder.raw_decode(body, i)
        except ValueError:
            return items
        items.append(item)


def _call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}

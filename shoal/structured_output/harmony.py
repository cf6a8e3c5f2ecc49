"""gpt-oss's harmony output format, read from its text (special tokens kept): the reasoning
parser `openai_gptoss` and the tool call parser `openai` (vLLM's names).

An assistant turn is a run of messages. The chat template ends the prompt with
`<|start|>assistant`, so the output starts at a message's header:

    <|channel|>analysis<|message|>Let me think.<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

or, for a tool call (the recipient in the header, before or after the channel, and an
optional `<|constrain|>json` content type; the call ends the turn):

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The analysis channel is the reasoning (`reasoning_content`); final messages, and commentary
without a recipient (a preamble to calls), are the answer (`content`); a message with a
recipient `functions.NAME` is a call of NAME (other recipients, gpt-oss's built-in browser
and python tools, keep their whole name). Text without any harmony marker is all answer
(a model that did not use the format, or special tokens skipped).

The reasoning parser hands the answer on with each call kept as one canonical call message
(`<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>`), which the tool call
parser then extracts; so the two work through the same interfaces as the other parsers, and
a stream holds back what may become a call from the call marker on."""

from __future__ import annotations

import re
from dataclasses import dataclass

from shoal.structured_output.reasoning_parsers import ReasoningParser
from shoal.structured_output.tool_parsers import ExtractedToolCalls, ToolCall, ToolParser

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
CONSTRAIN, END, CALL, RETURN = "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
_RECIPIENT = re.compile(r"\bto=(\S+)")
CALL_MARKER = f"{CHANNEL}commentary to="


@dataclass
class HarmonyMessage:
    channel: str = ""
    recipient: str | None = None
    content_type: str = ""
    body: str = ""
    header_done: bool = False  # <|message|> seen: the body follows
    done: bool = False  # its terminator seen

    @property
    def call_name(self) -> str | None:
        if self.recipient is None:
            return None
        return self.recipient.removeprefix("functions.")


def has_markers(text: str) -> bool:
    return any(m in text for m in MARKERS)


def parse_messages(text: str) -> list[HarmonyMessage]:
    """The messages of a (possibly partial) assistant turn, in order. Text outside any
    message (before the first marker, or after a terminator) counts as answer text."""
    messages: list[HarmonyMessage] = []
    msg: HarmonyMessage | None = None  # the message being read (None after a terminator)
    header, field = "", ""

    def begin() -> HarmonyMessage:
        nonlocal header
        header = ""
        messages.append(HarmonyMessage())
        return messages[-1]

    for part in _SPLIT.split(text):
        if not part:
            continue
        if part == START:
            msg, field = begin(), "role"
        elif part in (END, CALL, RETURN):
            if msg is not None:
                msg.done = True
            msg = None
        elif part in (CHANNEL, CONSTRAIN):
            if msg is None or msg.header_done:
                msg = begin()
            field = "channel" if part == CHANNEL else "type"
        elif part == MESSAGE:
            msg = msg if msg is not None and not msg.header_done else begin()
            msg.header_done = True
            found = _RECIPIENT.search(header)
            msg.recipient = found[1] if found else None
        else:  # text
            if msg is None:
                msg = begin()
                msg.header_done = True
            if msg.header_done:
                msg.body += part
                continue
            header += " " + part
            words = part.split()
            if field == "channel" and words:
                msg.channel = words[0]
            elif field == "type":
                msg.content_type = part.strip()
    return messages


def _held(text: str) -> int:
    """Characters at the end of a partial text that may be the start of a marker."""
    for k in range(min(len(text), max(len(m) for m in MARKERS) - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in MARKERS):
            return k
    return 0


def split_harmony(text: str, final: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a turn's text; the answer keeps each call as one canonical call
    message for the tool call parser. A partial text (final=False) gives what is certain."""
    if not final:
        text = text[:len(text) - _held(text)]
    if not has_markers(text):
        return None, text or None
    reasoning: list[str] = []
    answer = ""
    for msg in parse_messages(text):
        if not msg.header_done:
            continue  # its channel and recipient are not known yet
        if msg.recipient is not None:
            answer += f"{CALL_MARKER}{msg.recipient}{MESSAGE}{msg.body}"
            answer += CALL if msg.done else ""
        elif msg.channel == "analysis":
            reasoning.append(msg.body)
        else:  # final, or a commentary preamble
            answer += msg.body
    return "\n".join(reasoning) or None, answer or None


class HarmonyReasoningParser(ReasoningParser):
    """--reasoning-parser openai_gptoss. Needs the special tokens in the text: the chat
    server keeps them for it (keeps_special_tokens)."""

    keeps_special_tokens = True

    def __init__(self) -> None:
        super().__init__("openai_gptoss", unterminated_is_reasoning=False)

    def split(self, text: str) -> tuple[str | None, str | None]:
        return split_harmony(text)

    def streamer(self) -> HarmonyStream:
        return HarmonyStream()


class HarmonyStream:
    """A streamed turn: each feed returns the (reasoning, answer) deltas certain so far."""

    def __init__(self) -> None:
        self.text = ""
        self._sent = ["", ""]

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        parts = [p or "" for p in split_harmony(self.text, final)]
        out = []
        for i, part in enumerate(parts):
            # a stream only grows, except a call's header: nothing of it is sent before
            # <|message|>, so a sent prefix never changes
            new = part[len(self._sent[i]):] if part.startswith(self._sent[i]) else ""
            self._sent[i] = part if part.startswith(self._sent[i]) else self._sent[i]
            out.append(new)
        return out[0], out[1]


class HarmonyToolParser(ToolParser):
    """--tool-call-parser openai: the calls of a harmony turn (after openai_gptoss split off
    the reasoning, or in the raw turn)."""

    name = "openai"
    marker = CALL_MARKER
    keeps_special_tokens = True

    def extract(self, text: str) -> ExtractedToolCalls:
        if not has_markers(text):
            return ExtractedToolCalls(self._content(text), [])
        calls, content = [], ""
        for msg in parse_messages(text):
            if not msg.header_done:
                continue
            if msg.recipient is not None:
                calls.append(ToolCall(msg.call_name or msg.recipient, msg.body.strip()))
            elif msg.channel != "analysis":
                content += msg.body
        return ExtractedToolCalls(self._content(content), calls)

    def start_index(self, text: str) -> int | None:
        """Where a call begins (or may begin): its marker, or in a raw turn a header not
        complete yet (its recipient is still unknown)."""
        i = super().start_index(text)
        if i is not None:
            return i
        open_header = text.rfind(CHANNEL)
        if open_header >= 0 and MESSAGE not in text[open_header:]:
            return open_header
        return None

"""The reasoning of thinking models split from their answer (--reasoning-parser): the text
between <think> and </think> is `reasoning_content`, the rest `content`.

qwen3: without </think> the whole text is the answer (thinking was switched off).
deepseek_r1: the template opens <think> in the prompt, so without </think> the whole text is
reasoning (the answer was cut off while thinking)."""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass
class ReasoningParser:
    name: str
    unterminated_is_reasoning: bool
    # the format is in special tokens (harmony): the chat server keeps them in the text
    keeps_special_tokens = False

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer."""
        body = text[len(START):] if text.startswith(START) else text
        end = body.find(END)
        if end < 0:
            if self.unterminated_is_reasoning or text.startswith(START):
                return body or None, None
            return None, text
        reasoning, content = body[:end], body[end + len(END):]
        return reasoning or None, content.lstrip("\n") or None

    def streamer(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """Splits a streamed answer: each `feed` returns the (reasoning, content) deltas that are
    certain so far; a possible start of a tag is held back until it is decided."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        visible = self.text
        if not final:
            if START.startswith(visible):
                return "", ""  # may still be the opening tag
            visible = visible[:len(visible) - _held(visible, END)]
        reasoning, content = self.parser.split(visible)
        reasoning, content = reasoning or "", content or ""
        r, c = reasoning[self._sent_reasoning:], content[self._sent_content:]
        self._sent_reasoning = max(self._sent_reasoning, len(reasoning))
        self._sent_content = max(self._sent_content, len(content))
        return r, c


def _held(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", unterminated_is_reasoning=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", unterminated_is_reasoning=True),
}


def builtin_reasoning_parser(name: str) -> ReasoningParser | None:
    """The <think>-tag parsers; shoal/structured_output/parsers.py looks up every name."""
    return REASONING_PARSERS.get(name)

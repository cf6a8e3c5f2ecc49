"""Engine logprobs -> the two OpenAI formats (legacy completions and chat)."""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable, Sequence
from typing import Any

from shoal.entrypoints.openai.responses import CompletionLogprobs, TokenLogprob, TopLogprob
from shoal.outputs import Logprob, PositionLogprobs

# JSON has no -Infinity; a token the model rules out gets this instead (as vLLM does).
MIN_LOGPROB = -9999.0


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token's text, as the logprobs fields show it ("" without a tokenizer)."""
    return tokenizer.decode([token_id]) if tokenizer is not None else ""


def clamp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def _text(lp: Logprob | None, token_id: int, decode: Callable[[int], str] | None) -> str:
    """A token as the logprobs fields show it; decode None means vLLM's
    return_tokens_as_token_ids ("token_id:42": exact even for a token that is half a
    character)."""
    if decode is None:
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode(token_id)


def prompt_logprobs_entries(positions: Sequence[PositionLogprobs | None],
                            decode: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt position, token id -> {logprob, rank,
    decoded_token} (None for the first token, which nothing predicts)."""
    return [None if pos is None else
            {str(t): {"logprob": clamp(lp.logprob), "rank": lp.rank,
                      "decoded_token": lp.decoded_token if lp.decoded_token is not None
                      else decode(t)}
             for t, lp in pos.items()}
            for pos in positions]


def _top(position: PositionLogprobs, k: int | None) -> list[tuple[int, Logprob]]:
    """The top-k entries by rank (the chosen token carries its true rank, maybe > k); k None:
    every entry in order (logprob_token_ids: the sampled token, then the asked ids)."""
    if k is None:
        return list(position.items())
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k]
    ranked.sort(key=lambda e: e[1].rank)
    return ranked


def completion_logprobs(token_ids: Sequence[int],
                        positions: Sequence[PositionLogprobs | None],
                        k: int | None, decode: Callable[[int], str] | None,
                        initial_offset: int = 0,
                        token_bytes: Callable[[int], bytes] | None = None,
                        chars: codecs.IncrementalDecoder | None = None) -> CompletionLogprobs:
    """`tokens/token_logprobs/top_logprobs/text_offset`; a None position (the first prompt
    token) has no logprob. Offsets index into the choice's text: with token_bytes (a token's
    own bytes), by the characters the tokens' bytes complete, so a token that is part of a
    character does not count its U+FFFD. chars: a stream's UTF-8 decoder, carried from one
    chunk to the next (a character may start in one and end in the next)."""
    out = CompletionLogprobs()
    offset = initial_offset
    if token_bytes is None:
        chars = None
    elif chars is None:
        chars = utf8_counter()
    for tid, pos in zip(token_ids, positions):
        chosen = pos.get(tid) if pos is not None else None
        text = _text(chosen, tid, decode)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text) if chars is None else len(chars.decode(token_bytes(tid)))
        if pos is None or chosen is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp(chosen.logprob))
        # The chosen token first (as vLLM), then the k most likely ones.
        top = {text: clamp(chosen.logprob)}
        for t, lp in _top(pos, k):
            top.setdefault(_text(lp, t, decode), clamp(lp.logprob))
        out.top_logprobs.append(top)
    return out


def utf8_counter() -> codecs.IncrementalDecoder:
    """An incremental UTF-8 decoder (invalid bytes as U+FFFD, as the text decodes them)."""
    return codecs.getincrementaldecoder("utf-8")("replace")


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs],
                  k: int | None, decode: Callable[[int], str] | None,
                  token_bytes: Callable[[int], bytes] | None = None) -> list[TokenLogprob]:
    """Chat's logprobs content. token_bytes: a token's own bytes (token_bytes.py), so that a
    position's bytes rebuild the text where a token is half a character; None: the bytes of
    the shown text."""
    def raw(token_id: int, text: str) -> list[int]:
        return list(token_bytes(token_id) if token_bytes is not None else text.encode("utf-8"))

    content = []
    for tid, pos in zip(token_ids, positions):
        chosen = pos.get(tid)
        text = _text(chosen, tid, decode)
        top = [TopLogprob(token=(s := _text(lp, t, decode)), logprob=clamp(lp.logprob),
                          bytes=raw(t, s))
               for t, lp in _top(pos, k)]
        content.append(TokenLogprob(
            token=text, logprob=clamp(chosen.logprob) if chosen else MIN_LOGPROB,
            bytes=raw(tid, text), top_logprobs=top))
    return content

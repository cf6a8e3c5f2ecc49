"""Incremental detokenization with stop strings, for streaming one request's output.

Each step decodes only a small window of ids (prefix/read offsets) instead of the whole
output, so cost per token stays constant. Text that ends in U+FFFD is an incomplete UTF-8
character (byte-level BPE splits characters across tokens), so it is held back until a later
token completes it; a request that ends before it does ends without it (as vLLM's text: a
client never sees half a character as U+FFFD).

As vLLM's, the text leaves out the token that ended the request (EOS or one of its
stop_token_ids) unless include_stop_str_in_output, and stop strings count only in text
that comes after the first min_tokens tokens. Apart from those, the text is
`tokenizer.decode` of the output ids.

The first output tokens are decoded with the last few prompt tokens as left context, i.e. as
a continuation of the prompt. For byte-level BPE this equals `tokenizer.decode(output_ids)`;
for sentencepiece-style decoders it keeps the leading space that decoding the output alone
would strip.

Cost: two small decodes per update. The window only grows while the text keeps ending in an
incomplete character (or only invisible tokens arrive), which valid output never sustains.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shoal.engine.stop_checker import find_stop, holdback_len

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Prompt ids used as left context: enough for tokenizers whose decoders depend on the previous
# token (e.g. sentencepiece leading-space stripping) to decode the first output token right.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, incrementally, and applies stop strings."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: str | Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        if isinstance(stop, str):  # a lone string is one stop string, not a list of chars
            stop = [stop]
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that ended the output, if any
        self._fast_decode = _backend_decode(tokenizer)

        context = [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # Prompt ends mid-character: its bytes would merge with the output's, so decode the
            # output on its own, as tokenizer.decode(output_ids) would.
            context, context_text = [], ""
        # Decode window: _window[:_read] decodes to _prefix_text and ends on a character
        # boundary (it is context only); _window[_read:] decodes to _pending or gets confirmed.
        self._window: list[int] = context
        self._read = len(context)
        self._prefix_text = context_text
        self._confirmed = ""  # decoded text of output ids up to _read
        self._pending = ""
        self._checked = 0  # chars of stable text already searched for stop strings
        self._sent = 0  # chars already returned by get_delta

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Appends tokens; returns the stop string matched (text is then truncated at it), else None.

        Tokens arriving after a stop are ignored (they can come from an in-flight step). Tokens
        in the same update after the stop string are kept in `token_ids`; only text is truncated.
        stop_terminated: the last token ended the request (EOS, a stop token id); its text is
        left out unless include_stop_str_in_output.
        """
        if self.stop_reason is not None or len(new_token_ids) == 0:
            return None
        ids = [int(t) for t in new_token_ids]  # accept numpy/torch ints too
        first = self.min_tokens - len(self.token_ids)  # tokens still before min_tokens
        if self.stop and 0 < first < len(ids):
            # several tokens at once (a verify step): the text of the first min_tokens is
            # not searched, so it goes in first, as vLLM checks token by token
            self.update(ids[:first])
            return self.update(ids[first:], stop_terminated)
        self.token_ids.extend(ids)
        if stop_terminated and not self.include_stop_str_in_output:
            ids = ids[:-1]
            if not ids:
                return None
        self._window.extend(ids)

        text = self._decode(self._window)
        new_text = text[len(self._prefix_text) :]
        if new_text.endswith(REPLACEMENT_CHAR):
            self._pending = new_text  # wait for the rest of the character
            return self._check_stop()
        self._confirmed += new_text
        self._pending = ""
        if new_text:
            # Slide the window: what was just read (ending on a char boundary) becomes the prefix.
            del self._window[: self._read]
            self._prefix_text = self._decode(self._window)
        else:
            # Only invisible tokens (e.g. skipped specials): keep the old prefix as context.
            self._prefix_text = text
        self._read = len(self._window)
        return self._check_stop()

    @property
    def output_text(self) -> str:
        """Full text so far (truncated at a matched stop string), without an incomplete
        character at its end."""
        return self._stable_text()

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def get_delta(self, finished: bool) -> str:
        """Text not returned by earlier calls.

        While not finished, holds back incomplete characters and any tail that could still turn
        into a stop string; when finished (or stopped), flushes everything.
        """
        if finished or self.stop_reason is not None:
            text = self.output_text
        else:
            text = self._stable_text()
            text = text[: len(text) - holdback_len(text, self.stop)]
        if len(text) <= self._sent:
            return ""
        delta, self._sent = text[self._sent :], len(text)
        return delta

    def _stable_text(self) -> str:
        # Trailing U+FFFD in _pending may still change; everything before it is final.
        return self._confirmed + self._pending.rstrip(REPLACEMENT_CHAR)

    def _check_stop(self) -> str | None:
        if not self.stop:
            return None
        text = self._stable_text()
        if len(self.token_ids) <= self.min_tokens:  # (vLLM: stop strings after min_tokens)
            self._checked = len(text)
            return None
        match = find_stop(text, self.stop, self._checked)
        self._checked = len(text)
        if match is None:
            return None
        self._confirmed = text[: match.end if self.include_stop_str_in_output else match.start]
        self._pending = ""
        self.stop_reason = match.stop
        return match.stop

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )


def _backend_decode(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The Rust tokenizer's own decode when the wrapper would add nothing to it (a fast
    tokenizer that does not clean up spaces): the wrapper's argument conversion costs
    several times the decode itself, and this runs twice per streamed token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode

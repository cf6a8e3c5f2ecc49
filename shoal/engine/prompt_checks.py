"""Checks of a prompt's token ids, shared by every way a prompt comes in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class PromptTooLong(ValueError):
    """A prompt that leaves no room in max_model_len; `param` names the request field (a
    server's error body: "prompt", which a chat server reports as "messages")."""

    param = "prompt"


def check_prompt_token_ids(ids: Any, vocab_size: int, max_model_len: int) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError("prompt_token_ids must be a list of integers")
    ids = list(ids)
    if not ids:
        raise ValueError("prompt must not be empty (prompt_token_ids is empty)")
    # C-speed checks first (a 4k-token prompt is checked on every request's critical path);
    # the Python scans only run to name the offending id.
    if set(map(type, ids)) != {int}:
        bad = next(t for t in ids if type(t) is not int)
        raise ValueError(f"prompt_token_ids must be integers (got {bad!r})")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if t < 0 or t >= vocab_size)
        raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}): token id {bad} is "
                         "out of vocabulary")
    if len(ids) >= max_model_len:  # (vLLM's phrase, which clients match)
        raise PromptTooLong(f"This model's maximum context length is {max_model_len} tokens. "
                         f"However, your prompt is {len(ids)} tokens; it must be shorter than "
                         f"max_model_len ({max_model_len}) to leave room for the output")
    return ids


"""vLLM's truncate_prompt_tokens: how many prompt tokens a request keeps, and which.
Dependency-free: SamplingParams, PoolingParams, the input processor and the servers use it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def truncate_prompt(ids: list[int], keep: int | None, side: str | None,
                    max_input: int | None = None) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep `keep` tokens (-1: max_input, which a -1 needs),
    dropping from the left (the default: the end of a prompt matters most) or the right."""
    if keep is None:
        return ids
    if keep < 0:
        assert max_input is not None, "truncate_prompt_tokens=-1 needs max_input"
        keep = max_input
    if keep >= len(ids):
        return ids
    return ids[len(ids) - keep:] if (side or "left") == "left" else ids[:keep]


def check_truncate_prompt_tokens(value: int | None) -> None:
    """None, -1 (as many as fit) or >= 1 (SamplingParams, PoolingParams)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"truncate_prompt_tokens must be an integer (got {value!r})")
    if value < -1 or value == 0:
        raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1 (got {value})")


# The side a generation prompt loses (vLLM loads generation tokenizers with
# truncation_side="left": the end of a prompt matters most); pooling inputs lose their end
# (the tokenizer's side, "right" for BERT).
GENERATION_SIDE = "left"


def pooling_side(tokenizer: Any) -> str:
    """The side a pooling input loses: its tokenizer's truncation side, else the right."""
    return getattr(tokenizer, "truncation_side", None) or "right"


def kept_tokens(truncate: int | None, max_model_len: int, max_input: int) -> int | None:
    """How many tokens truncate_prompt_tokens keeps (-1: max_input); None: no cut. More than
    max_model_len is refused."""
    if truncate is None:
        return None
    if truncate > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({truncate}) must not be greater than "
                         f"max_model_len ({max_model_len})")
    return max_input if truncate < 0 else truncate


def encode_kept(encode: Callable[[bool], list[int]], keep: int | None, side: str
                ) -> list[int]:
    """A text's ids cut to `keep`, as a tokenizer truncates: the special tokens it adds
    ([CLS] ... [SEP], a BOS) stay and the text's own tokens are cut on `side`. encode(with
    special tokens) gives the ids."""
    ids = encode(True)
    if keep is None or len(ids) <= keep:
        return ids
    plain = encode(False)
    head = next((p for p in range(len(ids) - len(plain) + 1)
                 if ids[p:p + len(plain)] == plain), None)
    room = keep - (len(ids) - len(plain))
    if head is None or room < 1:  # (no special tokens apart, or only they fit: cut them all)
        return truncate_prompt(ids, keep, side)
    return ids[:head] + truncate_prompt(plain, room, side) + ids[head + len(plain):]

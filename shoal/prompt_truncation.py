"""vLLM's truncate_prompt_tokens: how many prompt tokens a request keeps, and which.
Dependency-free: SamplingParams, PoolingParams, the input processor and the servers use it."""

from __future__ import annotations


def truncate_prompt(ids: list[int], keep: int | None, side: str | None, max_input: int
                    ) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep `keep` tokens (-1: max_input), dropping from the
    left (the default: the end of a prompt matters most) or the right."""
    if keep is None:
        return ids
    if keep < 0:
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

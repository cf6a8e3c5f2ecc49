"""Prompt lookup (method "ngram"): the drafts are what followed the latest earlier
occurrence of the context's last n tokens, longest n first. Pure Python on the host."""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens continuing `tokens`, or [] when no suffix of min_n..max_n tokens
    occurred earlier. The latest earlier match wins (the most local context)."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = list(tokens[total - n:])
        first = suffix[0]
        # Scan backwards from the latest possible start (which must leave a token to copy).
        for start in range(total - n - 1, -1, -1):
            if tokens[start] == first and list(tokens[start:start + n]) == suffix:
                follow = start + n
                return list(tokens[follow:min(follow + k, total)])
    return []

"""Score requests: which (text_1, text_2) pairs a request means, and the score of an
embedding pair. Shared by the offline LLM.score and the server's /score and /rerank.

Pairing follows vLLM: one text_1 against each text_2 (1 -> N), or element-wise (N -> N).
A cross-encoder (a one-label classifier) reads each pair as one sequence; an embedding model
embeds both sides and scores their cosine similarity."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def score_pairs(text_1: str | Sequence, text_2: str | Sequence) -> list[tuple]:
    """The (left, right) pairs of a score request; a side is a string (or token ids) or a
    list of them."""
    left = [text_1] if _is_single(text_1) else list(text_1)
    right = [text_2] if _is_single(text_2) else list(text_2)
    if not left:
        raise ValueError("text_1 must not be empty")
    if not right:
        raise ValueError("text_2 must not be empty")
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise ValueError(f"text_1 and text_2 must have the same number of items, or text_1 "
                         f"one item (got {len(left)} and {len(right)})")
    return list(zip(left, right))


def _is_single(x: object) -> bool:
    """A string, or a list of token ids (one prompt); a list of those is several."""
    if isinstance(x, str):
        return True
    return isinstance(x, Sequence) and bool(x) and all(type(t) is int for t in x)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / denom) if denom > 0 else 0.0

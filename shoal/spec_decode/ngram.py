"""Prompt lookup (method "ngram"): the drafts are what followed the latest earlier
occurrence of the context's last n tokens, longest n first. On the host, in numpy (a
Python scan of a 2,000-token context per request per step would cost milliseconds)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shoal.config.speculative import SpeculativeConfig
from shoal.spec_decode.host_drafter import HostDrafter


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int
                  ) -> list[int]:
    """Up to k draft tokens continuing `tokens`, or [] when no suffix of min_n..max_n tokens
    occurred earlier. The latest earlier match wins (the most local context)."""
    seq = np.asarray(tokens, dtype=np.int64)
    total = len(seq)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # Windows that start early enough to leave a token after them to copy.
        windows = np.lib.stride_tricks.sliding_window_view(seq[:total - 1], n)
        hits = np.flatnonzero((windows == seq[total - n:]).all(axis=1))
        if len(hits):
            follow = int(hits[-1]) + n
            return seq[follow:min(follow + k, total)].tolist()
    return []


class NgramDrafter(HostDrafter):
    """Prompt lookup over the request's prompt and outputs (method "ngram")."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def draft(self, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
        return propose_ngram([*prompt, *output], self.k, self.min_n, self.max_n)

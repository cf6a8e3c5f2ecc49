"""Test-only method "test_forced_acceptance": always k drafts (the last token repeated: their
values do not matter) and a verifier that accepts a set share of them, so timing runs on
random weights see a chosen acceptance rate. Per verified request, floor(a * k + u) drafts
are accepted (u uniform): on average a share a of the draft tokens. Never lossless."""

from __future__ import annotations

import random
from collections.abc import Sequence

from shoal.config.speculative import SpeculativeConfig
from shoal.spec_decode.host_drafter import HostDrafter


class ForcedAcceptance(HostDrafter):
    def __init__(self, config: SpeculativeConfig, seed: int = 0):
        self.k = config.num_speculative_tokens
        self.rate = config.acceptance_rate
        self._rng = random.Random(seed)

    def draft(self, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
        last = output[-1] if output else prompt[-1]
        return [last] * self.k

    def accept_mask(self, drafts_per_request: list[int]) -> list[bool]:
        return forced_accept_mask(self.rate, self._rng, drafts_per_request)


def forced_accept_mask(rate: float, rng: random.Random,
                       drafts_per_request: list[int]) -> list[bool]:
    """Per sampling row of a verify step (k + 1 rows per request with k drafts): whether
    that row's draft counts as accepted (floor(rate * k + u) drafts per request)."""
    mask: list[bool] = []
    for k in drafts_per_request:
        m = min(k, int(rate * k + rng.random()))
        mask.extend([j < m for j in range(k)] + [False])
    return mask

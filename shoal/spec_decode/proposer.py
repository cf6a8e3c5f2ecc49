"""Draft proposers: after a request samples, the drafts its next step verifies."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shoal.config.speculative import FORCED, SpeculativeConfig
from shoal.spec_decode.ngram import propose_ngram

if TYPE_CHECKING:
    from shoal.config import EngineConfig


class NgramProposer:
    """Prompt lookup over the request's prompt and outputs (method "ngram")."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
        return propose_ngram(list(prompt) + list(output), self.k, self.min_n, self.max_n)


class ForcedAcceptance:
    """Test-only ("test_forced_acceptance"): always k drafts (the last token repeated: their
    values do not matter), and a verifier that accepts a set share of them, so timing runs on
    random weights see a chosen acceptance rate. Per verified request, floor(a*k + u) drafts
    are accepted (u uniform): on average a share a of the draft tokens."""

    def __init__(self, config: SpeculativeConfig, seed: int = 0):
        self.k = config.num_speculative_tokens
        self.rate = config.acceptance_rate
        self._rng = random.Random(seed)

    def propose(self, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
        last = output[-1] if output else prompt[-1]
        return [last] * self.k

    def accept_mask(self, drafts_per_row: list[int]) -> list[bool]:
        """Per sampling row of a verify step (k+1 rows per request with k drafts): whether
        that row's draft counts as accepted."""
        mask: list[bool] = []
        for k in drafts_per_row:
            m = min(k, int(self.rate * k + self._rng.random()))
            mask.extend([j < m for j in range(k)] + [False])
        return mask


def build_proposer(engine_config: EngineConfig, target: Any = None, loaded: Any = None) -> Any:
    """The proposer of engine_config.speculative_config (None: no speculation). Methods "mtp"
    and "eagle" need the target model and its LoadedModel (config and checkpoint)."""
    config = engine_config.speculative_config
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == FORCED:
        return ForcedAcceptance(config)
    if config.method == "draft_model":
        from shoal.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(engine_config, config)
    if config.method in ("mtp", "eagle"):
        from shoal.spec_decode.mtp import HiddenStateProposer, build_mtp_head

        if target is None or loaded is None:
            raise ValueError(f"speculative_config: method {config.method!r} needs the target "
                             "model")
        if config.method == "mtp":
            head = build_mtp_head(engine_config, target, loaded)
        else:
            from shoal.spec_decode.eagle_head import build_eagle_head

            head = build_eagle_head(engine_config, config, target, loaded)
        return HiddenStateProposer(engine_config, config, head)
    raise ValueError(f"speculative_config: method {config.method!r} is not supported yet")

"""Test-only overlay, speculative_config forced_acceptance_rate a (never lossless): a real
method's drafter (eagle3, eagle, mtp, draft_model, ngram) drafts as usual, its forward
passes, KV cache and CUDA graphs included, and the verify step runs its real forward pass and
rejection-sampler work; only the accept decision is replaced, by test_forced_acceptance's
rule (forced.py): floor(a * k + u) of a request's k verified drafts are accepted, u uniform,
and every row keeps the target's own token. Timing runs on random weights can so weigh a
drafter's cost against what it would buy at a chosen acceptance.

Where it hooks: the accept decision is made on the host side of sampling, never in a CUDA
graph (the verify graphs hold the forward pass; the rejection sampler runs after them). Every
sampled step the runner already asks its drafter for a forced mask (Drafter.accept_mask,
None for the real drafters), and the rejection sampler takes one as test_forced_acceptance's;
the overlay answers there. Without the setting nothing is overlaid: no work in the step.

Confidence-scheduled verification: a random head's probabilities are about 1 / vocab, so no
draft would ever be verified. With confidence_threshold set, the overlay reports each
draft's probability as a, once the head has computed its own (their cost is paid): a
drafter whose confidence matches the forced acceptance, so at a = 0 the scheduler verifies
nothing (plain decode steps plus the drafter's cost) and at a = 1 every draft."""

from __future__ import annotations

import logging
import random
from typing import Any

from shoal.config.speculative import SpeculativeConfig
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.spec_decode.forced import forced_accept_mask
from shoal.worker.drafter import Drafter

logger = logging.getLogger(__name__)


class ForcedAcceptanceOverlay:
    """The forced rule put on one drafter; `rate` may be changed between requests (the
    benchmark's sweep over rates on one engine)."""

    def __init__(self, drafter: Drafter, rate: float, confidence: bool, seed: int = 0):
        self.rate = rate
        self._rng = random.Random(seed)
        self._propose = drafter.propose
        drafter.accept_mask = self.accept_mask  # type: ignore[method-assign]
        if confidence:
            drafter.propose = self.propose  # type: ignore[method-assign]

    def accept_mask(self, drafts_per_request: list[int]) -> list[bool]:
        return forced_accept_mask(self.rate, self._rng, drafts_per_request)

    def propose(self, step: Any, state: Any, out: ModelRunnerOutput, latest: bool) -> None:
        self._propose(step, state, out, latest)
        for serial, probs in out.draft_probs.items():
            out.draft_probs[serial] = [self.rate] * len(probs)


def overlay_forced_acceptance(drafter: Drafter | None,
                              config: SpeculativeConfig) -> Drafter | None:
    """The drafter, with the forced rule on it when config.forced_acceptance_rate is set."""
    rate = config.forced_acceptance_rate
    if drafter is None or rate is None:
        return drafter
    logger.warning("speculative_config forced_acceptance_rate=%s: test-only, %s drafts are "
                   "accepted by a forced rule, not by the target (output is not the target's "
                   "decoding)", rate, config.method)
    drafter.forced_acceptance = ForcedAcceptanceOverlay(  # type: ignore[attr-defined]
        drafter, rate, config.confidence_threshold is not None)
    return drafter

"""The adaptive draft budget's estimate while a request's drafts are not verified (issue 38):
it returns to the prior (0.8), not to 0.5, so a request with good drafts verifies again at a
large batch; a request whose drafts never pay still backs off there; and above 32 running
the worth threshold follows running / (running + WORTH_HALF_BATCH), which a request at the
prior can pass at 64 (the old ramp's 0.9 there was out of the estimate's reach)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shoal.core.request import Request
from shoal.engine import draft_budget
from shoal.engine.draft_budget import (
    ACCEPT_DECAY,
    PRIOR_HITS,
    DraftBudget,
    acceptance_estimate,
    adaptive_num_drafts,
    age_counts,
    worth_threshold,
)
from shoal.sampling_params import SamplingParams

K, STEPS = 4, 256
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _request() -> Request:
    return Request("r", [5, 6, 7], SamplingParams(max_tokens=10_000), frozenset(), 10_000,
                   arrival_time=0.0)


def _decode(budget: DraftBudget, req: Request, running: int, allowed: bool = True) -> int:
    """One decode step with k drafts proposed: how many the budget verifies."""
    req.spec_token_ids = [11] * K
    return budget.num_drafts(req, 100, allowed, running)


def test_unverified_counts_return_to_the_prior() -> None:
    prior = acceptance_estimate(PRIOR_HITS, 0.0)
    assert prior == pytest.approx(0.8)
    for hits, fails in ((0.0, 9.0), (20.0, 0.0), (1.0, 2.0)):
        gaps = []
        for _ in range(40):
            hits, fails = age_counts(hits, fails, verified=False)
            gaps.append(abs(acceptance_estimate(hits, fails) - prior))
        assert gaps[-1] < 1e-3 and gaps == sorted(gaps, reverse=True), gaps
    # a verified step decays toward 0 (settle adds its outcome), as before
    assert age_counts(5.0, 2.0, verified=True) == (5.0 * ACCEPT_DECAY, 2.0 * ACCEPT_DECAY)


def test_good_request_drafts_again_after_unverified_steps() -> None:
    """Five all-accepted verify steps, then 30 decode steps whose drafts are not verified
    (pipelined steps, allowed=False): the estimate is back at the prior, not at 0.5, so at 48
    running (threshold 0.545) the request verifies drafts again; before the fix: none."""
    budget, req = DraftBudget(K, 100_000), _request()
    for _ in range(5):
        n = _decode(budget, req, 1)
        budget.settle(req, n, n)
    assert acceptance_estimate(req.spec_hits, req.spec_fails) > 0.9
    for _ in range(30):
        assert _decode(budget, req, 48, allowed=False) == 0
    assert acceptance_estimate(req.spec_hits, req.spec_fails) == pytest.approx(0.8, abs=0.01)
    assert worth_threshold(48) > 0.5  # where the old drift's 0.5 verified nothing
    assert _decode(budget, req, 48) >= 1


def test_estimate_under_the_threshold_recovers_at_a_large_batch() -> None:
    """A bad patch (estimate 0.4 under 48 running's threshold): the request verifies nothing
    for a few steps while its counts move toward the prior, then verifies again (before the
    fix its estimate sank toward 0.5, under the threshold for good)."""
    budget, req = DraftBudget(K, 100_000), _request()
    req.spec_hits, req.spec_fails = 1.0, 2.0
    verified = [_decode(budget, req, 48) for _ in range(6)]
    assert verified[0] == 0 and any(verified), verified
    assert req.spec_skip == 0  # a step skipped by the threshold is no miss


def test_failing_drafts_still_back_off_at_batch_48() -> None:
    """Drafts never accepted at 48 running: few verify steps in 256 and few steps drafted
    (the simulator, benchmarks/draft_budget_sim.py: 14 and 25 per request in lockstep; before
    the fix 1 and 256: the budget skipped them, no miss was counted, the drafter ran on)."""
    budget, req = DraftBudget(K, 100_000), _request()
    verified = drafted = 0
    for _ in range(STEPS):
        drafted += req.spec_skip == 0
        n = _decode(budget, req, 48)
        if n:
            budget.settle(req, n, 0)
            verified += 1
    assert verified <= 16 and drafted <= 32, (verified, drafted)
    assert req.spec_backoffs >= 3


def test_worth_threshold_above_32() -> None:
    """Unchanged up to 32 running; above, n / (n + WORTH_HALF_BATCH) up to MAX_WORTH: a
    request at the prior (0.8) verifies two drafts at 64 running (0.8, 0.64 >= 0.615), one
    at 0.5 none."""
    span = draft_budget.DRAFT_COST_FULL_BATCH - draft_budget.DRAFT_COST_FREE_BATCH
    for n in range(1, 33):
        x = min(max(n - draft_budget.DRAFT_COST_FREE_BATCH, 0) / span, 1.0)
        ramp = draft_budget.MIN_WORTH + x * (draft_budget.MAX_WORTH - draft_budget.MIN_WORTH)
        assert worth_threshold(n) == ramp
    for n in (33, 48, 64, 128):
        assert worth_threshold(n) == pytest.approx(n / (n + draft_budget.WORTH_HALF_BATCH))
    assert adaptive_num_drafts(PRIOR_HITS, 0.0, K, worth_threshold(64)) == 2
    assert adaptive_num_drafts(1.0, 1.0, K, worth_threshold(64)) == 0
    assert worth_threshold(10_000) == draft_budget.MAX_WORTH


@pytest.fixture
def sim():
    sys.path.insert(0, str(BENCH))
    try:
        import draft_budget_sim
        yield draft_budget_sim
    finally:
        sys.path.remove(str(BENCH))


def test_simulated_batch_48_pays_again(sim) -> None:
    """The simulator (one lockstep run of 48 requests, a = 0.8): speculation pays with the
    current rule and did not with the old one (it reproduces it: 256 steps)."""
    cost = sim.CostModel()
    current = sim.simulate(sim.Point("geometric", "off", "current", 48, 0.8), cost, 48)
    old = sim.simulate(sim.Point("geometric", "off", "session12", 48, 0.8), cost, 48)
    assert current.ratio > 1.2 and current.steps < 150, current
    assert old.ratio < 1.0 and old.steps > 250, old


def test_drafts_without_blocks_age_the_counts_as_unverified() -> None:
    """Drafts granted by num_drafts that the step cannot take for want of blocks: the counts
    end where a step verifying none leaves them (age_counts), not decayed toward 0."""
    from shoal.engine.draft_budget import age_counts

    budget = DraftBudget(4, 10_000)
    req = _request()
    req.spec_hits, req.spec_fails = 1.0, 2.0
    req.spec_token_ids = [7, 7, 7, 7]
    assert budget.num_drafts(req, 100, True, 1) > 0
    budget.not_verified(req)
    want = age_counts(1.0, 2.0, verified=False)
    assert (req.spec_hits, req.spec_fails) == pytest.approx(want)

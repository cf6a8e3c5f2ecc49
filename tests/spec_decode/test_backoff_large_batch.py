"""The backoff at a full batch (issue 38): drafts that never pay stop being drafted for a
while, with the adaptive budget's large-batch threshold and with confidence-scheduled
verification alike, so the steps pipeline as plain decoding does."""

from __future__ import annotations

from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from spec_decode.proposal_log import StepLog
from spec_decode.test_spec_engine import SpecCounter

from shoal import SamplingParams
from shoal.core.request import Request
from shoal.engine.draft_budget import DraftBudget
from shoal.sampling_params import SamplingParams as SP

K, BATCH, STEPS = 4, 32, 256


def _request() -> Request:
    return Request("r", [5, 6, 7], SP(max_tokens=10_000), frozenset(), 10_000, arrival_time=0.0)


def _verify_steps(budget: DraftBudget, probs: list[float], running: int) -> tuple[int, int]:
    """One request's decode steps with k drafts (probabilities `probs`) of which none is ever
    accepted: (steps that verify drafts, steps whose drafts were weighed at all)."""
    req = _request()
    verified = weighed = 0
    for _ in range(STEPS):
        req.spec_token_ids, req.spec_probs = [11] * K, probs
        weighed += req.spec_skip == 0
        n = budget.num_drafts(req, 100, True, running)
        if n:
            budget.settle(req, n, 0)
            verified += 1
    return verified, weighed


def test_failing_drafts_back_off_at_a_full_batch_as_alone() -> None:
    """At 32 running the adaptive budget stops verifying before the estimate falls below
    BACKOFF_BELOW, and the decay brought it back every ~6 steps (37 verify steps of 256);
    eight misses in a row back off too, and three while no draft was ever accepted: as few
    verify steps as a request alone (9: three misses, then one probe after each pause of 4,
    8, 16, 32, 64 and 64 steps; 13 before the first-hit rule, whose estimate needed six
    misses to leave the prior, issue 38)."""
    alone, _ = _verify_steps(DraftBudget(K, 100_000), [], 1)
    full, _ = _verify_steps(DraftBudget(K, 100_000), [], BATCH)
    assert alone == full == 9, (alone, full)


def test_three_misses_back_off_a_request_never_accepted() -> None:
    """MISSES_BEFORE_FIRST_HIT: a new request's estimate is still the prior's 0.8 after three
    misses; with no draft of it ever accepted they pause it all the same, and one accepted
    draft later the estimate rule alone decides again (the next test)."""
    budget, req = DraftBudget(K, 100_000), _request()
    for _ in range(3):
        req.spec_token_ids = [11] * K
        assert req.spec_skip == 0
        budget.settle(req, budget.num_drafts(req, 100, True, 1), 0)
    assert req.spec_skip == 4 and not req.spec_ever_accepted
    # a request with an accepted draft behind it is not paused by three misses
    budget, req = DraftBudget(K, 100_000), _request()
    req.spec_token_ids = [11] * K
    budget.settle(req, budget.num_drafts(req, 100, True, 1), 1)
    for _ in range(3):
        req.spec_token_ids = [11] * K
        budget.settle(req, budget.num_drafts(req, 100, True, 1), 0)
    assert req.spec_ever_accepted and req.spec_skip == 0


def test_seven_misses_in_a_row_do_not_back_off() -> None:
    """The rule's other side (W9 batch 32, a = 0.5, where backing off cost 0.80x plain):
    drafts right half the time miss seven in a row one run in 128; a request whose verify
    steps go one accepted, seven misses, over and over (its estimate stays above
    BACKOFF_BELOW) never backs off, and keeps verifying (45 of 256 steps)."""
    budget, req = DraftBudget(K, 100_000), _request()
    verified = 0
    for _ in range(STEPS):
        req.spec_token_ids = [11] * K
        n = budget.num_drafts(req, 100, True, BATCH)
        if n:
            budget.settle(req, n, int(verified % 8 == 0))
            verified += 1
        assert req.spec_skip == 0
    assert verified >= 40


def test_confidence_skips_back_off() -> None:
    """Drafts skipped for low confidence count as misses: two in a row and the request stops
    being drafted for 4 steps, doubling up to 64 (wants_drafts says no meanwhile),
    so its drafter runs a few times in 256 steps, not every step."""
    budget, req = DraftBudget(K, 100_000, confidence=0.5), _request()
    req.num_computed_tokens = req.num_tokens - 1  # its next step decodes one token
    assert budget.wants_drafts([req], False)
    for _ in range(2):
        req.spec_token_ids, req.spec_probs = [11] * K, [0.01] * K
        assert budget.num_drafts(req, 100, True, BATCH) == 0
    assert req.spec_skip == 4 and not budget.wants_drafts([req], False)
    verified, weighed = _verify_steps(DraftBudget(K, 100_000, confidence=0.5), [0.01] * K, BATCH)
    assert verified == 0 and weighed <= 12, weighed
    # sure drafts still verify all k, and an accepted one ends the backoff
    req.spec_skip, req.spec_token_ids, req.spec_probs = 0, [11] * K, [1.0] * K
    assert budget.num_drafts(req, 100, True, 1) == K
    budget.settle(req, K, 1)
    assert req.spec_misses == req.spec_backoffs == 0


def _sp(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_forced_zero_at_batch_32_pipelines(tiny_llama_dir) -> None:
    """Forced acceptance 0, 32 requests in lockstep, 120 tokens: a handful of verify steps
    (17 before the fix), every other step pipelined; output is plain decoding's."""
    prompts = random_prompts(BATCH, seed=4, lo=4, hi=12)
    plain = tiny_llm(tiny_llama_dir, num_gpu_blocks_override=1200)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, _sp(120), use_tqdm=False)]
    llm = tiny_llm(tiny_llama_dir, async_scheduling=True, num_gpu_blocks_override=1200,
                   speculative_config={"method": "test_forced_acceptance",
                                       "num_speculative_tokens": K, "acceptance_rate": 0.0})
    log = StepLog(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _sp(120), use_tqdm=False)]
    assert got == want
    assert log.verifies <= 12, log.verifies
    assert len(log.steps) - log.pipelined <= 2 * log.verifies + 2, log.steps
    assert not log.verify_pipelined() and blocks_all_free(llm)


def test_confidence_at_forced_zero_stops_drafting(eagle3_target_and_head) -> None:
    """eagle3 with confidence scheduling at forced acceptance 0 (each draft's probability
    reported as 0): nothing is verified, and after the backoff the steps pipeline and the
    head proposes only now and then (before the fix: every step, none pipelined)."""
    target, head = eagle3_target_and_head
    llm = tiny_llm(target, load_format="dummy", async_scheduling=True,
                   num_gpu_blocks_override=1200, speculative_config={
                       "method": "eagle3", "model": str(head), "num_speculative_tokens": K,
                       "forced_acceptance_rate": 0.0, "confidence_threshold": 0.5})
    drafter = llm.llm_engine.core.runner.drafter
    proposals: list[bool] = []
    inner = drafter.propose

    def propose(step, state, out, latest):
        proposals.append(latest)
        return inner(step, state, out, latest)
    drafter.propose = propose
    log, counter = StepLog(llm), SpecCounter(llm)
    llm.generate(random_prompts(BATCH, seed=5, lo=4, hi=12), _sp(100), use_tqdm=False)
    assert counter.draft_tokens == 0
    assert sum(proposals) <= 12, sum(proposals)  # proposals made for the next step
    assert log.pipelined >= len(log.steps) - 12, (log.pipelined, len(log.steps))
    assert blocks_all_free(llm)

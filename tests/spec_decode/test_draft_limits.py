"""Draft limits (engine/draft_budget.py, issue 38): each scheduled decode step carries, per
outcome of its own verification, the drafts its next step can verify at most, so a drafter
drafts no deeper and keeps the rows of a request whose limit is 0 (no mirror, no drafts).

The limits are checked against the budget itself: over random acceptance runs at several
batch sizes, the count the next step verifies equals the limit the previous step gave for
its actual outcome (the batch unchanged, room and max_tokens unbounded, confidence off). In
a tiny EAGLE-3 engine whose random head drafts badly (acceptance near 0), output stays plain
greedy decoding, every draft is the head's formula recomputed from scratch, no request is
proposed more drafts than its limit, and limits of 0 keep rows that a later step catches up."""

from __future__ import annotations

import random

import pytest
from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from spec_decode.proposal_log import record_proposals
from spec_decode.test_eagle3 import ckpt  # noqa: F401 (the fixture)

from shoal import SamplingParams
from shoal.core.request import Request
from shoal.engine.draft_budget import DraftBudget, draft_limits, drafts_paused
from shoal.spec_decode.drafting_rows import next_step_limit

K = 4


def _request() -> Request:
    return Request("r", [5, 6, 7], SamplingParams(max_tokens=100_000), frozenset(), 100_000,
                   arrival_time=0.0)


@pytest.mark.parametrize("running", [1, 8, 20, 32, 48, 64])
@pytest.mark.parametrize("accept", [0.0, 0.3, 0.6, 0.9])
def test_the_next_step_verifies_what_the_limit_said(running, accept) -> None:
    rng = random.Random(int(running * 100 + accept * 10))
    budget, req = DraftBudget(K, 1_000_000), _request()
    predicted: int | None = None
    checked = zeros = 0
    for _ in range(400):
        req.spec_token_ids = [11] * K
        n = budget.num_drafts(req, 100, True, running)
        if predicted is not None:
            assert n == predicted, (n, predicted, req)
            checked += 1
        limits = req.spec_draft_limits
        if req.spec_skip:  # backing off past this step: no limits (drafts_paused decides)
            assert limits == ()
            predicted = None
            continue
        assert len(limits) == n + 1 and all(0 <= lim <= K for lim in limits)
        a = 0
        while a < n and rng.random() < accept:
            a += 1
        if n:
            budget.settle(req, n, a)
        predicted = limits[a]
        zeros += predicted == 0
    assert checked >= 20  # (at acceptance 0 most steps back off)
    if accept == 0.0 and running >= 32:  # the budget's zeros: the drafter skips them now
        assert zeros > 0


def test_a_step_whose_every_outcome_gives_no_draft_is_paused() -> None:
    req = _request()
    # 32 running (threshold 0.44), estimate ~0.4: no draft is worth verifying next step
    req.spec_hits, req.spec_fails = 1.0, 3.0
    budget = DraftBudget(K, 1_000_000)
    req.spec_token_ids = []
    assert budget.num_drafts(req, 100, True, 32) == 0
    assert req.spec_draft_limits == (0,)
    assert drafts_paused(req, 0)
    assert not budget.wants_drafts([req], proposals_known=False) or req.spec_skip
    # one running: the same estimate verifies a draft (threshold 0.1)
    req.spec_hits, req.spec_fails = 1.0, 3.0
    assert budget.num_drafts(req, 100, True, 1) == 0
    assert req.spec_draft_limits[0] >= 1 and not drafts_paused(req, 0)
    # without the adaptive budget nothing is limited; disable_by_batch_size limits to 0
    assert DraftBudget(K, 100, adaptive=False).num_drafts(req, 100, True, 1) == 0
    assert req.spec_draft_limits == ()
    DraftBudget(K, 100, disable_by_batch_size=4).num_drafts(req, 100, True, 4)
    assert req.spec_draft_limits == (0,)


def test_a_full_miss_that_backs_off_limits_to_zero() -> None:
    # two misses in a row at a low estimate back the request off (draft_budget.py)
    limits = draft_limits(0.5, 2.0, 1, 2, K, 0.1)
    assert limits[0] == 0 and limits[1] >= 1 and limits[2] >= limits[1]


def test_next_step_limit_picks_the_outcome() -> None:
    assert next_step_limit((), 3) is None
    assert next_step_limit((2,), 1) == 2
    assert next_step_limit((0, 1, 4), 1) == 0  # nothing accepted: one row mirrored
    assert next_step_limit((0, 1, 4), 3) == 4  # two accepted
    assert next_step_limit((0, 1, 4), 9) == 4
    assert next_step_limit((0, 1, 4), 0) is None


def test_eagle3_drafts_no_deeper_than_the_limits(ckpt, monkeypatch) -> None:  # noqa: F811
    target, folder, ref = ckpt
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = random_prompts(6, seed=5, lo=2, hi=24)
    want = [o.outputs[0].token_ids for o in tiny_llm(target).generate(prompts, sp,
                                                                       use_tqdm=False)]
    llm = tiny_llm(target, max_num_seqs=6, speculative_config={
        "method": "eagle3", "model": str(folder), "num_speculative_tokens": K})
    core = llm.llm_engine.core
    drafter = core.runner.drafter
    limits_seen: list[int | None] = []
    deferred_by_limit, shallow = [0], [0]
    inner = drafter.mirror_and_propose

    def mirror_and_propose(reqs, hidden, failed, propose=True):
        for r in reqs:
            limits_seen.append(r.limit)
            deferred_by_limit[0] += r.limit == 0
        out = inner(reqs, hidden, failed, propose)
        limit = {r.serial: r.limit for r in reqs}
        for serial, d in out.items():  # each request's drafts stop at its own limit
            assert limit[serial] is None or len(d) <= limit[serial], (limit[serial], d)
            shallow[0] += 0 < len(d) < K
        return out
    monkeypatch.setattr(drafter, "mirror_and_propose", mirror_and_propose)
    log = record_proposals(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert any(lim is not None and lim < K for lim in limits_seen), limits_seen
    assert deferred_by_limit[0] > 0  # limits of 0 kept rows for later
    assert shallow[0] > 0  # proposals cut short by a limit
    assert log
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq
    assert blocks_all_free(llm)

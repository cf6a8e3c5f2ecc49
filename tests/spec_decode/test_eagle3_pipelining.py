"""An EAGLE-3 drafter whose drafts keep failing, under async scheduling (issue 38): the
drafter's work that the device waits for is only the proposals a verify step uses.

A step that runs alone (a verify step, and the step whose results its drafts come from) is
followed by a gap: the device idles from its end until the next launch, and a drafter's
pass run at its finish (a mirror, a proposal: ~2 ms on an H100 for an 8B-wide head) is in
that gap. Two kinds bought nothing there (W9's shape on the CPU, forced acceptance 0, batch
1: 7 of 20 proposals unverified, 6 catch-ups in such gaps, in 256 steps;
benchmarks/eagle3_pipelining_count.py):
- the proposal after a verify step whose miss backs the request off: the scheduler now marks
  such a verify step's request paused-on-a-miss (ScheduledRequest.drafts_paused), and a
  full miss leaves exactly one row, which the drafter keeps for later instead of mirroring
  and drafting (a step that accepts drafts leaves more rows and is mirrored and drafted as
  before);
- the catch-up of a paused request's kept rows at the finish of the step its next drafts
  come from: the step before that one, whose finish runs beside the next step's forward pass,
  now mirrors (the request is not marked paused there), so the drafting step's finish
  mirrors one row.
Output stays plain greedy decoding, and every draft stays the EAGLE-3 formula's."""

from __future__ import annotations

import itertools

import pytest
from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from spec_decode.proposal_log import record_proposals
from spec_decode.test_eagle3 import ckpt  # noqa: F401 (the fixture)

from shoal import SamplingParams
from shoal.core.request import Request
from shoal.engine.draft_budget import DraftBudget, backs_off_on_a_miss, drafts_paused
from shoal.sampling_params import SamplingParams as SP
from shoal.spec_decode import mirror_backlog

K = 3


class DrafterGaps:
    """Wraps an engine's drafter: each proposal's fate (whether the request's next step
    verifies drafts) and each catch-up of kept rows, counted as critical when made while no
    later step was in flight (the device then waits for it)."""

    def __init__(self, llm, monkeypatch):
        core = llm.llm_engine.core
        drafter = core.runner.drafter
        self.verified = self.unverified = 0
        self.catch_ups = self.critical_catch_ups = 0
        pending: set[int] = set()
        execute, mirror, take = core.runner.execute, drafter.mirror_and_propose, \
            mirror_backlog.take

        def counted_execute(sched):
            for it in sched.scheduled:
                if it.serial in pending:
                    pending.discard(it.serial)
                    if it.num_draft_tokens:
                        self.verified += 1
                    else:
                        self.unverified += 1
            return execute(sched)

        def counted_mirror(reqs, hidden, failed, propose=True):
            drafts = mirror(reqs, hidden, failed, propose=propose)
            pending.update(s for s, d in drafts.items() if d)
            return drafts

        def counted_take(state, context_len):
            got = take(state, context_len)
            if got is not None:
                self.catch_ups += 1
                self.critical_catch_ups += len(core.queue) <= 1
            return got

        core.runner.execute, drafter.mirror_and_propose = counted_execute, counted_mirror
        monkeypatch.setattr(mirror_backlog, "take", counted_take)


def _plain(target, prompts, sp):
    return [o.outputs[0].token_ids for o in tiny_llm(target).generate(prompts, sp,
                                                                       use_tqdm=False)]


def test_failing_drafts_leave_the_device_waiting_only_for_used_proposals(
        ckpt, monkeypatch) -> None:  # noqa: F811
    """Forced acceptance 0, one request, 100 tokens: three misses, then the backoff probes
    again after 4, 8, 16, 32 steps; no proposal goes unverified and no catch-up is on the
    critical path (before: one of each per probe)."""
    target, folder, ref = ckpt
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompts = random_prompts(1, seed=21, lo=5, hi=20)
    llm = tiny_llm(target, async_scheduling=True, speculative_config={
        "method": "eagle3", "model": str(folder), "num_speculative_tokens": K,
        "forced_acceptance_rate": 0.0})
    gaps, log = DrafterGaps(llm, monkeypatch), record_proposals(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == \
        _plain(target, prompts, sp)
    assert gaps.verified >= 7 and gaps.catch_ups >= 3, vars(gaps)
    assert gaps.unverified == 0 and gaps.critical_catch_ups == 0, vars(gaps)
    for seq, drafts in log:  # the head's KV after kept rows and catch-ups: the formula's
        assert drafts == ref.drafts(seq, len(drafts)), seq
    assert blocks_all_free(llm)


def _oracle_drafts(llm, prompts, plain) -> None:
    """The verified drafts become plain decoding's own next tokens, a varying number of them
    right (none, mostly; two on the first step, so that the backoff is the estimate's, not
    the first-hit rule's), so that some verify steps accept drafts, backoffs included; the
    head's own drafts (record_proposals) are still its formula's."""
    drafter = llm.llm_engine.core.runner.drafter
    whole = {tuple(p["prompt_token_ids"]): out for p, out in zip(prompts, plain)}
    propose = drafter.propose

    def oracle(step, state, out, latest):
        propose(step, state, out, latest)
        for serial, st in zip(step.inputs.sample_rows, step.inputs.sample_states):
            drafts = out.draft_token_ids.get(serial)
            if not drafts:
                continue
            done = len(st.output_token_ids)
            right = list(whole[tuple(st.prompt_token_ids)][done:done + len(drafts)])
            n = min(len(right), 2 if done == 1 or done % 10 == 6 else 0)
            out.draft_token_ids[serial] = right[:n] + [(t + 1) % 512 for t in drafts[n:]]
    drafter.propose = oracle


def test_drafts_accepted_on_a_step_marked_for_a_miss_are_drafted_from(ckpt) -> None:  # noqa: F811
    """Real verification (lossless), several requests out of step, drafts right now and then:
    a verify step marked paused-on-a-miss that accepts drafts is mirrored and drafted from
    (its rows came from the ring); output is plain greedy decoding and every draft of the
    head is its formula's."""
    target, folder, ref = ckpt
    sp = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    prompts = random_prompts(3, seed=22, lo=3, hi=25)
    plain = _plain(target, prompts, sp)
    llm = tiny_llm(target, async_scheduling=True, max_num_seqs=4, speculative_config={
        "method": "eagle3", "model": str(folder), "num_speculative_tokens": K})
    core = llm.llm_engine.core
    log = record_proposals(llm)
    _oracle_drafts(llm, prompts, plain)
    marked: dict[int, bool] = {}  # serial -> its verify step in flight is marked
    outcomes: list[tuple[bool, int]] = []  # (marked, accepted) of each verify step
    execute, settle = core.runner.execute, core.scheduler.drafts.settle

    def counted_execute(sched):
        marked.update((it.serial, it.drafts_paused) for it in sched.scheduled
                      if it.num_draft_tokens)
        return execute(sched)

    def counted_settle(req, num_drafts, accepted):
        outcomes.append((marked[req.serial], accepted))
        return settle(req, num_drafts, accepted)
    core.runner.execute, core.scheduler.drafts.settle = counted_execute, counted_settle
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == plain
    assert any(m and a for m, a in outcomes) and any(m and not a for m, a in outcomes), \
        outcomes
    assert len(log) > 10
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq
    assert blocks_all_free(llm)


def test_a_miss_backs_off_exactly_where_the_scheduler_predicts() -> None:
    """backs_off_on_a_miss (the scheduler's mark) against DraftBudget.settle itself, over
    acceptance counts and miss streaks around every threshold, for requests with an
    accepted draft behind them and without (the first-hit rule)."""
    budget = DraftBudget(4, 10_000)
    cases = {True: 0, False: 0}
    for hits, fails, misses, ever in itertools.product(
            (0.0, 0.3, 0.8, 1.5, 3.0), (0.0, 0.5, 1.0, 2.0, 3.5, 6.0), range(10),
            (True, False)):
        req = Request("r", [5, 6, 7], SP(max_tokens=100), frozenset(), 100, arrival_time=0.0)
        req.spec_hits, req.spec_fails, req.spec_misses = hits, fails, misses
        req.spec_ever_accepted = ever
        predicted = backs_off_on_a_miss(req)
        budget.settle(req, 4, 0)
        assert predicted == (req.spec_skip > 0), (hits, fails, misses, ever)
        cases[ever] += predicted
    assert 0 < cases[True] < cases[False] < 300, cases


@pytest.mark.parametrize("skip, paused", [(0, False), (1, False), (2, True), (5, True)])
def test_the_step_before_the_last_paused_one_is_mirrored(skip, paused) -> None:
    """Countdown of a backoff after the step's own: paused while the step after next still
    backs off; the step whose next step is the last paused one is mirrored (its finish runs
    beside that step, and catches the kept rows up)."""
    req = Request("r", [5, 6, 7], SP(max_tokens=100), frozenset(), 100, arrival_time=0.0)
    req.spec_skip = skip
    assert drafts_paused(req, num_drafts=0) is paused
    # without pipelined steps that finish is the latest one: it would draft for a step that
    # verifies nothing, so every step still backing off is paused
    assert drafts_paused(req, num_drafts=0, pipelined=False) is (skip > 0)

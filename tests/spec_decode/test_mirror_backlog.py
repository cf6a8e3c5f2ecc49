"""A request backing off from drafting (engine/draft_budget.py) is not mirrored into the
EAGLE-3 head's KV cache while paused; its rows are kept and mirrored, ahead of the step's
own, when drafting resumes (shoal/spec_decode/mirror_backlog.py). The tiny head's random
weights draft badly, so requests back off often, at different steps: the output is still
plain greedy decoding, every proposal after a catch-up is the EAGLE-3 formula recomputed
from scratch (so the caught-up KV is the step-by-step mirror's), and no head pass runs in a
step whose requests are all paused."""

from __future__ import annotations

import pytest
from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from spec_decode.proposal_log import record_proposals
from spec_decode.test_eagle3 import ckpt  # noqa: F401 (the fixture)
from spec_decode.test_mtp import build_checkpoints as mtp_checkpoints

from shoal import SamplingParams
from shoal.spec_decode import mirror_backlog
from shoal.spec_decode.drafting_rows import sampled_rows

K = 3


class MirrorCounter:
    """Steps launched (all paused, some paused) and the head's mirror passes."""

    def __init__(self, llm):
        runner = llm.llm_engine.core.runner
        drafter = runner.drafter
        self.steps = self.all_paused = self.some_paused = self.mirrors = 0
        inner_execute, inner_run, inner_propose = (runner.execute, drafter._run_depth,
                                                   drafter._propose)
        drafting = [False]

        def execute(sched):
            if not sched.is_empty:
                paused = [it.drafts_paused for it in sched.scheduled]
                self.steps += 1
                self.all_paused += all(paused)
                self.some_paused += any(paused) and not all(paused)
            return inner_execute(sched)

        def run_depth(depth, ids, positions, hidden, md):
            self.mirrors += not drafting[0]  # (the eager draft steps run inside _propose)
            return inner_run(depth, ids, positions, hidden, md)

        def propose(*args):
            drafting[0] = True
            try:
                return inner_propose(*args)
            finally:
                drafting[0] = False
        runner.execute, drafter._run_depth, drafter._propose = execute, run_depth, propose


def count_catch_ups(monkeypatch) -> list[int]:
    """The rows of every backlog a mirror runs ahead of its step's own."""
    rows: list[int] = []
    inner = mirror_backlog.take

    def take(state, context_len):
        back = inner(state, context_len)
        if back is not None:
            rows.append(back.end - back.start)
        return back
    monkeypatch.setattr(mirror_backlog, "take", take)
    return rows


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_paused_requests_are_mirrored_later(ckpt, async_scheduling,  # noqa: F811
                                            monkeypatch) -> None:
    target, folder, ref = ckpt
    monkeypatch.setattr(mirror_backlog, "MAX_ROWS", 1000)  # every paused row waits
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 20, 40)]
    prompts = random_prompts(3, seed=11, lo=2, hi=30)
    want = [o.outputs[0].token_ids for o in tiny_llm(target).generate(prompts, sp,
                                                                       use_tqdm=False)]
    # Two at a time: the third starts when the second ends, so steps mix paused and
    # drafting requests.
    llm = tiny_llm(target, async_scheduling=async_scheduling, max_num_seqs=2,
                   speculative_config={
        "method": "eagle3", "model": str(folder), "num_speculative_tokens": K})
    counter, log = MirrorCounter(llm), record_proposals(llm)
    caught = count_catch_ups(monkeypatch)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert blocks_all_free(llm)
    # Requests backed off, alone and together; a step of paused requests only ran no head
    # pass (every step mirrored one before: prompts of 2+ tokens, no chunks).
    assert counter.all_paused > 10 and counter.some_paused > 0
    assert counter.mirrors == counter.steps - counter.all_paused
    assert len(caught) > 3 and max(caught) >= 4  # backoffs of 4 steps and more, caught up
    for seq, drafts in log:  # the proposals after each catch-up included
        assert drafts == ref.drafts(seq, len(drafts)), seq


def test_a_full_backlog_is_mirrored_while_paused(ckpt, monkeypatch) -> None:  # noqa: F811
    """At MAX_ROWS kept rows a paused request is caught up anyway: no backlog grows past it,
    and the drafts after it are still the formula's."""
    target, folder, ref = ckpt
    monkeypatch.setattr(mirror_backlog, "MAX_ROWS", 3)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = random_prompts(2, seed=12, lo=2, hi=30)
    want = [o.outputs[0].token_ids for o in tiny_llm(target).generate(prompts, sp,
                                                                       use_tqdm=False)]
    llm = tiny_llm(target, speculative_config={
        "method": "eagle3", "model": str(folder), "num_speculative_tokens": K})
    counter, log = MirrorCounter(llm), record_proposals(llm)
    caught = count_catch_ups(monkeypatch)
    drafter = llm.llm_engine.core.runner.drafter
    inner, paused_drafted = drafter.mirror_and_propose, []

    def mirror_and_propose(reqs, hidden, failed, propose=True):
        drafts = inner(reqs, hidden, failed, propose=propose)
        # a paused request caught up with one row of its own (nothing accepted) is not
        # drafted for: its next step verifies none (drafting_rows.drafts_wanted)
        paused_drafted.extend(r.serial for r in reqs
                              if r.paused and sampled_rows(r, r.state) == 1
                              and r.serial in drafts)
        return drafts
    drafter.mirror_and_propose = mirror_and_propose
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert not paused_drafted
    assert max(caught) == 3 and counter.all_paused > 10
    assert counter.steps - counter.all_paused < counter.mirrors < counter.steps
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq


def test_mtp_backlog_is_lossless(tmp_path_factory) -> None:
    """A one-layer MTP head keeps the target's final hidden states (copied out of the
    step's buffer) the same way: plain greedy output, fewer mirror passes than steps, the
    MTP formula's drafts."""
    target, ref = mtp_checkpoints(tmp_path_factory.mktemp("mtp"))["random"]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = random_prompts(2, seed=13, lo=2, hi=30)
    want = [o.outputs[0].token_ids for o in tiny_llm(target).generate(prompts, sp,
                                                                       use_tqdm=False)]
    llm = tiny_llm(target, async_scheduling=True, speculative_config={
        "method": "mtp", "num_speculative_tokens": K})
    counter, log = MirrorCounter(llm), record_proposals(llm)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert counter.all_paused > 10 and counter.mirrors < counter.steps - 10
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq

"""speculative_config forced_acceptance_rate (test-only, shoal/spec_decode/forced_overlay.py):
a real drafter proposes and the forced rule accepts. At rate 0 no draft is accepted and the
output is plain greedy decoding (every step keeps only the target's first row); at rate 1
every verified draft is accepted, each row giving the target's own token: plain greedy again
when the drafts are the target's (a draft model equal to the target), otherwise only the
first two tokens are sure to be plain's (later rows saw the drafts in their context, which
the forced rule kept though the output holds the target's tokens)."""

from __future__ import annotations

import pytest
from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from spec_decode.proposal_log import record_proposals
from spec_decode.test_spec_engine import SpecCounter

from shoal import SamplingParams
from shoal.config.speculative import SpeculativeConfig

K = 3
# 1 token from the prefill, then k + 1 per verify step: never trimmed by max_tokens
SP = SamplingParams(temperature=0, max_tokens=1 + 3 * (K + 1), ignore_eos=True)


@pytest.fixture(scope="module")
def plain_ids(eagle3_target_and_head):
    llm = tiny_llm(eagle3_target_and_head[0], load_format="dummy")
    return _ids(llm.generate(random_prompts(3, seed=8, lo=2, hi=30), SP, use_tqdm=False))


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _run(llm, rate: float) -> tuple[list[list[int]], SpecCounter, list]:
    llm.llm_engine.core.runner.drafter.forced_acceptance.rate = rate
    counter, log = SpecCounter(llm), record_proposals(llm)
    ids = _ids(llm.generate(random_prompts(3, seed=8, lo=2, hi=30), SP, use_tqdm=False))
    assert blocks_all_free(llm)
    return ids, counter, log


def _spec(**kw) -> dict:
    return {"num_speculative_tokens": K, "forced_acceptance_rate": 0.0, **kw}


def test_eagle3_forced_none_then_all(eagle3_target_and_head, plain_ids) -> None:
    target, head = eagle3_target_and_head
    llm = tiny_llm(target, load_format="dummy",
                   speculative_config=_spec(method="eagle3", model=str(head)))
    ids, counter, log = _run(llm, 0.0)
    assert ids == plain_ids
    assert len(log) > 0 and counter.draft_tokens > 0 and counter.accepted == 0
    ids, counter, log = _run(llm, 1.0)
    assert len(log) > 0 and counter.drafts > 0
    assert counter.accepted == counter.draft_tokens == K * counter.drafts
    assert all(len(i) == SP.max_tokens for i in ids)
    assert [i[:2] for i in ids] == [i[:2] for i in plain_ids]


def test_confidence_scheduling_sees_the_forced_rate(eagle3_target_and_head) -> None:
    """A random head's own probabilities (~1/128) would verify nothing at threshold 0.5;
    the overlay reports the forced rate as each draft's probability."""
    target, head = eagle3_target_and_head
    llm = tiny_llm(target, load_format="dummy", speculative_config=_spec(
        method="eagle3", model=str(head), confidence_threshold=0.5))
    _, counter, log = _run(llm, 1.0)
    assert len(log) > 0 and counter.accepted == counter.draft_tokens == K * counter.drafts > 0
    _, counter, log = _run(llm, 0.0)
    assert len(log) > 0 and counter.draft_tokens == 0  # proposed, never verified


def test_draft_model_forced(eagle3_target_and_head, plain_ids) -> None:
    """The target as its own draft: every draft right, yet at rate 0 none is accepted."""
    target, _ = eagle3_target_and_head
    llm = tiny_llm(target, load_format="dummy",
                   speculative_config=_spec(method="draft_model", model=str(target)))
    llm.llm_engine.core.runner.drafter.forced_acceptance.rate = 0.0
    counter = SpecCounter(llm)
    prompts = random_prompts(3, seed=8, lo=2, hi=30)
    assert _ids(llm.generate(prompts, SP, use_tqdm=False)) == plain_ids
    assert counter.draft_tokens > 0 and counter.accepted == 0
    llm.llm_engine.core.runner.drafter.forced_acceptance.rate = 1.0
    counter = SpecCounter(llm)
    assert _ids(llm.generate(prompts, SP, use_tqdm=False)) == plain_ids
    assert counter.accepted == counter.draft_tokens == K * counter.drafts > 0


@pytest.mark.parametrize(("value", "message"), [
    ({"forced_acceptance_rate": 1.5}, "forced_acceptance_rate .*in \\[0, 1\\]"),
    ({"forced_acceptance_rate": -0.1}, "forced_acceptance_rate .*in \\[0, 1\\]"),
    ({"forced_acceptance_rate": "x"}, "forced_acceptance_rate .*in \\[0, 1\\]"),
    ({"forced_acceptance_rate": True}, "forced_acceptance_rate .*in \\[0, 1\\]"),
    ({"method": "test_forced_acceptance", "forced_acceptance_rate": 0.5},
     "forced_acceptance_rate is for a real method"),
])
def test_config_errors(value: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2, **value})


def test_config_default_and_value() -> None:
    base = {"method": "ngram", "num_speculative_tokens": 2}
    assert SpeculativeConfig.from_user(base).forced_acceptance_rate is None
    assert SpeculativeConfig.from_user({**base, "forced_acceptance_rate": 1}
                                       ).forced_acceptance_rate == 1

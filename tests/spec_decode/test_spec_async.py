"""Speculative decoding with async scheduling: steps that verify drafts run one at a time,
the others are pipelined (scheduled while the step before runs). Output stays the plain
engine's token for token; speculation that the backoff turned off pipelines like plain
decoding."""

from __future__ import annotations

from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from spec_decode.proposal_log import StepLog
from spec_decode.test_spec_engine import NGRAM, SpecCounter, _ids, _with_references

from shoal import SamplingParams


def test_async_speculation_is_lossless_and_never_pipelines_a_verify(tiny_llama_dir) -> None:
    plain = tiny_llm(tiny_llama_dir)
    llm = tiny_llm(tiny_llama_dir, speculative_config=NGRAM, async_scheduling=True)
    assert llm.llm_engine.core.async_scheduling
    prompts = random_prompts(10, seed=13)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    counter = _with_references(llm, plain, prompts, 24)
    log = StepLog(llm)
    want = _ids(plain.generate(prompts, sp, use_tqdm=False))
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    assert _ids(llm.generate(prompts[:1], sp, use_tqdm=False)) == want[:1]  # alone
    assert 0 < counter.accepted < counter.draft_tokens
    assert log.verifies > 0 and log.pipelined > 0, log.steps
    assert not log.verify_pipelined()
    assert blocks_all_free(llm)


def test_no_drafts_found_pipelines_every_decode(tiny_llama_dir) -> None:
    """Random prompts give ngram nothing to match: no request wants drafts, so every decode
    step after the first is pipelined, as without speculation."""
    plain = tiny_llm(tiny_llama_dir)
    llm = tiny_llm(tiny_llama_dir, speculative_config=NGRAM, async_scheduling=True)
    prompts = [{"prompt_token_ids": list(range(3 + 40 * i, 43 + 40 * i))} for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    log = StepLog(llm)
    out = _ids(llm.generate(prompts, sp, use_tqdm=False))
    assert out == _ids(plain.generate(prompts, sp, use_tqdm=False))
    if log.verifies == 0:  # the model's own tokens did not repeat the context
        assert log.pipelined >= len(log.steps) - 2, log.steps


def test_backoff_pipelines_at_zero_acceptance(tiny_llama_dir) -> None:
    """Forced acceptance 0 (every draft rejected): after the backoff turns drafting off the
    loop pipelines; it verifies again now and then, one step at a time."""
    plain = tiny_llm(tiny_llama_dir)
    llm = tiny_llm(tiny_llama_dir, async_scheduling=True, speculative_config={
        "method": "test_forced_acceptance", "num_speculative_tokens": 3,
        "acceptance_rate": 0.0})
    counter = SpecCounter(llm)
    log = StepLog(llm)
    prompts = random_prompts(2, seed=2, lo=5, hi=10)
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(
        plain.generate(prompts, sp, use_tqdm=False))
    assert counter.accepted == 0 and counter.drafts >= 4
    assert not log.verify_pipelined()
    assert log.pipelined >= 0.8 * len(log.steps), (log.pipelined, len(log.steps))
    assert blocks_all_free(llm)

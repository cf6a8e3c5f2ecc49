"""Speculative decoding end to end on the tiny random checkpoint: greedy output is the plain
engine's token for token, sampled output has its distribution, with real KV rollback,
preemption, abort and prefix caching. Random weights rarely agree with ngram drafts, so a
test proposer drafts from a known continuation, some drafts right and some wrong."""

from __future__ import annotations

import random
import time

import pytest
from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from spec_decode.chi_square import chi_square_p

from shoal import SamplingParams
from shoal.core.types import EngineCoreRequest
from shoal.spec_decode.host_drafter import HostDrafter

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


class ReferenceProposer(HostDrafter):
    """Drafts the next tokens of a reference continuation of the prompt, the first `right`
    of them as they are and the rest changed (right is random per proposal)."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], k: int = 3, seed: int = 0):
        self.refs, self.k, self.rng = refs, k, random.Random(seed)

    def draft(self, prompt, output) -> list[int]:
        ref = self.refs.get(tuple(prompt))
        if ref is None:
            return []
        n = len(output)
        drafts = list(ref[n:n + self.k])
        right = self.rng.randrange(self.k + 1)
        return [t if j < right else (t + 1) % 500 + 3 for j, t in enumerate(drafts)]


class SpecCounter:
    """Totals of the engine's spec_decode counters over its steps."""

    def __init__(self, llm):
        self.drafts = self.draft_tokens = self.accepted = 0
        sched = llm.llm_engine.core.scheduler
        inner = sched.stats

        def stats():
            s = inner()
            self.drafts += s.spec_num_drafts
            self.draft_tokens += s.spec_num_draft_tokens
            self.accepted += s.spec_num_accepted_tokens
            return s
        sched.stats = stats


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return tiny_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def spec(tiny_llama_dir):
    return tiny_llm(tiny_llama_dir, speculative_config=NGRAM)


def _with_references(llm, plain, prompts, max_tokens: int, seed: int = 0) -> SpecCounter:
    refs = _ids(plain.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                       ignore_eos=True), use_tqdm=False))
    llm.llm_engine.core.runner.drafter = ReferenceProposer(
        {tuple(p["prompt_token_ids"]): r for p, r in zip(prompts, refs)}, seed=seed)
    return SpecCounter(llm)


def test_greedy_is_token_for_token_the_plain_engine(plain, spec) -> None:
    prompts = random_prompts(12, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    counter = _with_references(spec, plain, prompts, 24)
    want = _ids(plain.generate(prompts, sp, use_tqdm=False))
    assert _ids(spec.generate(prompts, sp, use_tqdm=False)) == want
    assert _ids(spec.generate(prompts[:1], sp, use_tqdm=False)) == want[:1]  # alone
    assert 0 < counter.accepted < counter.draft_tokens  # partial acceptance happened
    assert blocks_all_free(spec)


def test_ngram_drafts_real_engine(plain, spec) -> None:
    """The real ngram proposer, on prompts that repeat: output unchanged."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}, {"prompt_token_ids": [11, 12] * 9}]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    from shoal.config.speculative import SpeculativeConfig
    from shoal.spec_decode.ngram import NgramDrafter

    spec.llm_engine.core.runner.drafter = NgramDrafter(SpeculativeConfig(**NGRAM))
    counter = SpecCounter(spec)
    assert _ids(spec.generate(prompts, sp, use_tqdm=False)) == _ids(
        plain.generate(prompts, sp, use_tqdm=False))
    assert counter.drafts > 0


def test_preemption_and_prefix_cache_with_speculation(tiny_llama_dir, plain) -> None:
    """A pool too small for the batch: speculating requests are preempted and recomputed;
    then a prompt extending a finished one hits its blocks. Output stays the plain one."""
    llm = tiny_llm(tiny_llama_dir, speculative_config=NGRAM, num_gpu_blocks_override=40,
                   max_num_batched_tokens=64)
    prompts = random_prompts(8, seed=5, lo=20, hi=40)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    counter = _with_references(llm, plain, prompts, 30, seed=1)
    want = _ids(plain.generate(prompts, sp, use_tqdm=False))
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    assert llm.llm_engine.core.scheduler.num_preemptions > 0 and counter.accepted > 0
    # Alone (its blocks stay cached), then a prompt that extends its output.
    assert _ids(llm.generate(prompts[:1], sp, use_tqdm=False)) == want[:1]
    follow = [{"prompt_token_ids": prompts[0]["prompt_token_ids"] + want[0][:24]}]
    hits = llm.llm_engine.core.scheduler.kv.prefix_hits
    assert _ids(llm.generate(follow, sp, use_tqdm=False)) == _ids(
        plain.generate(follow, sp, use_tqdm=False))
    assert llm.llm_engine.core.scheduler.kv.prefix_hits - hits >= 40
    assert blocks_all_free(llm)


def test_abort_mid_verify(plain, spec) -> None:
    prompts = random_prompts(3, seed=9)
    _with_references(spec, plain, prompts, 20)
    core = spec.llm_engine.core
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"abort{i}", p["prompt_token_ids"], sp,
                                           time.monotonic()))
    core.step()  # prefills; drafts proposed
    sched = core.scheduler.schedule()
    assert any(it.num_draft_tokens for it in sched.scheduled)
    handle = core.runner.execute(sched)
    core.runner.sample(handle, None)
    core.abort_requests(["abort1"])  # while the verify step is in flight
    outs = core.scheduler.update(sched, core.runner.finish(handle))
    assert [o.finish_reason for o in outs if o.request_id == "abort1"] == ["abort"]
    assert any(o.request_id == "abort0" and o.new_token_ids for o in outs)
    core.abort_requests(["abort0", "abort2"])
    core.step()
    assert blocks_all_free(spec)


class FixedProposer(HostDrafter):
    """The same drafts every time (deterministic given the context, as ngram's are)."""

    def __init__(self, drafts: list[int]):
        self.drafts, self.k = drafts, len(drafts)

    def draft(self, prompt, output) -> list[int]:
        return list(self.drafts)


# A logit bias gathers the mass on a few tokens, so drafts of them are often accepted (random
# weights alone spread it thin), and often rejected too.
BIAS = {42: 4.0, 17: 3.0}
SAMPLED = [
    (SamplingParams(temperature=0.6, top_k=6, top_p=0.9, logit_bias=BIAS, max_tokens=4,
                    ignore_eos=True), [42, 42, 42]),
    # the penalties push 42 down once it is out: drafts of what then comes up
    (SamplingParams(temperature=0.8, min_p=0.05, presence_penalty=0.8, logit_bias=BIAS,
                    repetition_penalty=1.3, frequency_penalty=0.3, max_tokens=4,
                    ignore_eos=True), [462, 17, 17]),
]


@pytest.mark.parametrize(("base", "drafts"), SAMPLED, ids=["t0.6-topk-topp", "penalties-minp"])
def test_sampled_distribution_matches_plain(plain, spec, base, drafts) -> None:
    """Thousands of seeded draws of the next 4 tokens of one prompt, with and without
    speculation: each position's tokens, and the pairs of the two verified positions, pass
    a chi-square test of one distribution."""
    n = 1500
    prompts = random_prompts(1, seed=11, lo=12, hi=13) * n
    spec.llm_engine.core.runner.drafter = FixedProposer(drafts)
    # 1,500 requests at once: the adaptive budget would verify no drafts at that batch.
    spec.llm_engine.core.scheduler.drafts.adaptive = False
    counter = SpecCounter(spec)

    def draws(llm, offset: int) -> list[list[int]]:
        params = [base.clone() for _ in range(n)]
        for i, p in enumerate(params):
            p.seed = offset + i
        return _ids(llm.generate(prompts, params, use_tqdm=False))

    a, b = draws(plain, 0), draws(spec, 10**6)
    # speculation did its part (hundreds of accepted drafts), and rejections too
    assert 100 < counter.accepted < 0.9 * counter.draft_tokens
    for pos in range(4):
        assert chi_square_p([x[pos] for x in a], [x[pos] for x in b]) > 0.01, pos
    assert chi_square_p([tuple(x[1:3]) for x in a], [tuple(x[1:3]) for x in b]) > 0.01
    assert chi_square_p([tuple(x[1:]) for x in a], [tuple(x[1:]) for x in b]) > 0.01
    spec.llm_engine.core.scheduler.drafts.adaptive = True

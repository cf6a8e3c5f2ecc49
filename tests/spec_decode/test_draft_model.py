"""Method draft_model on tiny random checkpoints: a draft equal to the target has every draft
accepted; a perturbed copy has some accepted; greedy output is the plain engine's either way
(also under preemption), sampled output keeps its distribution, and the draft's KV cache
comes out of the same memory budget."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from safetensors.torch import load_file, save_file
from spec_decode.chi_square import chi_square_p
from spec_decode.test_spec_engine import SpecCounter

from shoal import SamplingParams


def _draft(target, tmp_path, noise: float):
    """A copy of the target with noise on its weights: it mostly agrees with it."""
    out = tmp_path / f"draft-{noise}"
    shutil.copytree(target, out)
    path = out / "model.safetensors"
    weights = load_file(path)
    gen = torch.Generator().manual_seed(0)
    save_file({k: v + noise * torch.randn(v.shape, generator=gen) for k, v in weights.items()},
              path)
    return out


def _spec(target, draft, **kw):
    return tiny_llm(target, speculative_config={"method": "draft_model", "model": str(draft),
                                                "num_speculative_tokens": 3}, **kw)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return tiny_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def near_draft(tiny_llama_dir, tmp_path_factory):
    return _draft(tiny_llama_dir, tmp_path_factory.mktemp("drafts"), 0.03)


def test_draft_equal_to_target_has_every_draft_accepted(tiny_llama_dir, plain) -> None:
    llm = _spec(tiny_llama_dir, tiny_llama_dir)
    counter = SpecCounter(llm)
    prompts = random_prompts(5, seed=21)
    sp = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(
        plain.generate(prompts, sp, use_tqdm=False))
    assert counter.draft_tokens > 0 and counter.accepted == counter.draft_tokens
    assert blocks_all_free(llm)


def test_near_draft_is_lossless_with_preemption(tiny_llama_dir, plain, near_draft) -> None:
    llm = _spec(tiny_llama_dir, near_draft, num_gpu_blocks_override=40,
                max_num_batched_tokens=64)
    counter = SpecCounter(llm)
    prompts = random_prompts(8, seed=5, lo=20, hi=40)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(
        plain.generate(prompts, sp, use_tqdm=False))
    assert 0 < counter.accepted < counter.draft_tokens
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert blocks_all_free(llm)


def test_draft_cache_comes_from_the_same_budget(tiny_llama_dir, near_draft) -> None:
    budget = dict(num_gpu_blocks_override=None, kv_cache_memory_bytes=4 << 20)
    alone = tiny_llm(tiny_llama_dir, **budget).llm_engine.core.limits.num_kv_blocks
    shared = _spec(tiny_llama_dir, near_draft, **budget).llm_engine.core.limits.num_kv_blocks
    assert shared == alone // 2  # the draft has the target's shape: half each


def test_sampled_distribution_with_a_draft_model(tiny_llama_dir, plain, near_draft) -> None:
    n = 1200
    llm = _spec(tiny_llama_dir, near_draft)
    # 1,200 requests at once: the adaptive budget would verify no drafts at that batch.
    llm.llm_engine.core.scheduler.drafts.adaptive = False
    counter = SpecCounter(llm)
    prompts = random_prompts(1, seed=11, lo=12, hi=13) * n
    base = SamplingParams(temperature=0.5, top_k=8, top_p=0.95, max_tokens=4, ignore_eos=True)

    def draws(engine, offset: int) -> list[list[int]]:
        params = [base.clone() for _ in range(n)]
        for i, p in enumerate(params):
            p.seed = offset + i
        return _ids(engine.generate(prompts, params, use_tqdm=False))

    a, b = draws(plain, 0), draws(llm, 10**6)
    assert 100 < counter.accepted < counter.draft_tokens
    for pos in range(4):
        assert chi_square_p([x[pos] for x in a], [x[pos] for x in b]) > 0.01, pos
    assert chi_square_p([tuple(x[1:]) for x in a], [tuple(x[1:]) for x in b]) > 0.01


def test_async_scheduling_keeps_the_draft_cache_right(tiny_llama_dir, plain, tmp_path) -> None:
    """With async scheduling a far draft's failing drafts back off and steps are pipelined:
    the draft then mirrors input ids whose last token is still on the device. Every proposal
    after such stretches is still the draft model's own greedy continuation (its KV is
    right), and the output the target's."""
    from spec_decode.proposal_log import StepLog

    far = _draft(tiny_llama_dir, tmp_path, 0.3)
    llm = _spec(tiny_llama_dir, far, async_scheduling=True)
    assert llm.llm_engine.core.async_scheduling
    draft_alone = tiny_llm(far)
    log: list[tuple[list[int], list[int]]] = []
    proposer = llm.llm_engine.core.runner.drafter
    inner = proposer.propose_batch

    def recording(seqs, tables, depth=None):
        drafts = inner(seqs, tables, depth)
        log.extend((list(s), d) for s, d in zip(seqs, drafts) if d)
        return drafts
    proposer.propose_batch = recording
    steps = StepLog(llm)
    prompts = random_prompts(3, seed=17, lo=5, hi=20)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(
        plain.generate(prompts, sp, use_tqdm=False))
    assert steps.pipelined > 0 and steps.verifies > 0 and not steps.verify_pipelined()
    pipelined_at = [i for i, (p, _) in enumerate(steps.steps) if p]
    assert pipelined_at[0] < len(steps.steps) - 5  # proposals came after pipelined steps
    assert len(log) > 10
    for seq, drafts in log:
        want = _ids(draft_alone.generate([{"prompt_token_ids": seq}], SamplingParams(
            temperature=0, max_tokens=len(drafts), ignore_eos=True), use_tqdm=False))[0]
        assert drafts == want, seq
    assert blocks_all_free(llm)


def test_drafts_no_deeper_than_the_limits(tiny_llama_dir, plain, tmp_path) -> None:
    """The draft limits (issue 38): a draft that is right now and then (a farther one is
    never right, and its requests pause on the first-hit rule before any limit is shallow):
    its requests draft no more than their next step can verify for the outcome they had,
    none while paused (a paused verify step that accepted drafts is drafted from), and
    output stays the target's."""
    from shoal.spec_decode.drafting_rows import sampled_limit

    llm = _spec(tiny_llama_dir, _draft(tiny_llama_dir, tmp_path, 0.1), max_num_seqs=6)
    drafter = llm.llm_engine.core.runner.drafter
    seen = {"none": 0, "limited": 0, "shallow": 0}
    inner = drafter.propose

    def propose(step, state, out, latest):
        inner(step, state, out, latest)
        for it, st in zip(step.inputs.items, step.inputs.states):
            if not latest or not it.sample or it.serial not in out.sampled_token_ids:
                continue
            limit, drafts = sampled_limit(it, st), out.draft_token_ids.get(it.serial, [])
            accepted = st.num_tokens - 1 - it.context_len > 1  # (a verify step's drafts)
            if limit == 0 or (it.drafts_paused and not accepted):
                assert not drafts, (limit, drafts)
                seen["none"] += 1
            elif limit is not None:
                assert len(drafts) <= limit, (limit, drafts)
                seen["limited"] += 1
                seen["shallow"] += 0 < len(drafts) < 3
    drafter.propose = propose
    prompts = random_prompts(6, seed=8, lo=4, hi=20)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(
        plain.generate(prompts, sp, use_tqdm=False))
    assert seen["none"] > 0 and seen["shallow"] > 0, seen
    assert blocks_all_free(llm)

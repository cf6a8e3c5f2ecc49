"""The six findings of the last review pass (issue 18, item 6), each pinned by a test that
failed before its fix."""

from __future__ import annotations

from engine_helpers import blocks_all_free, nan_logits_for, random_prompts, tiny_llm

from shoal import SamplingParams


def _run(eng, finals: dict, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("did not finish")


def test_request_id_reused_while_its_old_step_is_in_flight(tiny_llama_dir):
    """Finding 1: results are matched on an internal serial, so a new request under the id
    of one aborted while its step is in flight never takes the old request's token."""
    old_prompt, new_prompt = random_prompts(2, seed=11, lo=12, hi=20)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = tiny_llm(tiny_llama_dir, async_scheduling=False).generate(
        new_prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = tiny_llm(tiny_llama_dir, async_scheduling=True)
    eng = llm.llm_engine
    eng.add_request("x", old_prompt, params)
    for _ in range(3):
        eng.step()
    assert eng.core.queue  # a step holding the old "x" is in flight
    eng.abort_request("x")
    eng.add_request("x", new_prompt, params)
    finals: dict = {}
    _run(eng, finals)
    got = finals["x"].outputs[0]
    assert got.finish_reason == "length" and got.token_ids == ref
    assert blocks_all_free(llm)


def test_nan_plus_preemption_never_zeroes_blocks_of_another_request(tiny_llama_dir):
    """Finding 2: "a" produces NaN logits in step 1 and is preempted in step 2 (scheduled
    before step 1's results are read), where "c" takes one of its blocks and writes into
    it. The blocks are zeroed by the scheduler, which knows that "c" owns that block now and
    has written its first slot: c's answer (tokens and logprobs) is that of c alone."""
    c_prompt, a_prompt = random_prompts(2, seed=12, lo=8, hi=9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    ref = tiny_llm(tiny_llama_dir, async_scheduling=False).generate(
        c_prompt, params, use_tqdm=False)[0].outputs[0]
    llm = tiny_llm(tiny_llama_dir, async_scheduling=True, num_gpu_blocks_override=4,
                   enable_prefix_caching=False)
    eng = llm.llm_engine
    hits = nan_logits_for(eng.core.runner, "a", times=1)
    eng.add_request("c", c_prompt, params)
    eng.add_request("a", a_prompt, params)
    finals: dict = {}
    _run(eng, finals)
    assert hits and eng.core.scheduler.num_preemptions >= 1
    assert finals["a"].outputs[0].finish_reason == "error"
    got = finals["c"].outputs[0]
    assert got.token_ids == ref.token_ids
    for lp, want in zip(got.logprobs, ref.logprobs):
        for tok, entry in want.items():
            assert abs(lp[tok].logprob - entry.logprob) < 1e-4
    assert blocks_all_free(llm)

"""Async scheduling (one step in flight) gives exactly the results of the one-step-at-a-time
loop. On the CPU nothing overlaps, but every path of the pipeline runs: input tokens taken
from the previous step's sampled ids, stops that land one step late, preemption and aborts
while a step is in flight, and the fall-back for penalties."""

from __future__ import annotations

import random

from engine_helpers import blocks_all_free, random_prompts, tiny_llm

from shoal import SamplingParams
from shoal.core.scheduler_output import PENDING_TOKEN


def _summary(outs) -> list:
    return [[(c.token_ids, c.finish_reason, c.stop_reason,
              [sorted(lp.items()) for lp in c.logprobs] if c.logprobs else None)
             for c in o.outputs] for o in outs]


def _mixed_params(n: int) -> list[SamplingParams]:
    rng = random.Random(7)
    params = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            sp = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 30), ignore_eos=True)
        elif kind == 1:
            sp = SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=rng.randrange(1, 30),
                                ignore_eos=True, logprobs=2)
        elif kind == 2:
            sp = SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=25, n=2,
                                ignore_eos=True)
        else:
            sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
        params.append(sp)
    return params


def test_async_matches_sync_on_a_mixed_batch(tiny_llama_dir):
    prompts = random_prompts(16, seed=1, lo=2, hi=50)
    params = _mixed_params(16)
    # A small budget: chunked prefills run beside decodes whose inputs are still in flight.
    sync = tiny_llm(tiny_llama_dir, async_scheduling=False, max_num_batched_tokens=64).generate(
        prompts, params, use_tqdm=False)
    async_llm = tiny_llm(tiny_llama_dir, async_scheduling=True, max_num_batched_tokens=64)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(sync)
    assert blocks_all_free(async_llm)


def test_steps_overlap_while_requests_decode(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, async_scheduling=True)
    eng = llm.llm_engine
    eng.add_request("a", random_prompts(1, seed=2, lo=10, hi=11)[0],
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    seen_pending = False
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        core = eng.core
        for launched in core.queue:
            seen_pending |= any(it.input_token_ids[-1] == PENDING_TOKEN
                                for it in launched.sched.scheduled)
    assert seen_pending  # decodes took their input from the step before, on the device
    # 1 prefill + 7 decodes are launched; the last result is read one step later.
    assert steps == 9


def test_stop_token_found_one_step_late_drops_the_extra_token(tiny_llama_dir):
    prompt = random_prompts(1, seed=3, lo=12, hi=13)[0]
    free = tiny_llm(tiny_llama_dir, async_scheduling=False).generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    stop = tokens[5]
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop])
    sync = tiny_llm(tiny_llama_dir, async_scheduling=False).generate(prompt, params, use_tqdm=False)
    llm = tiny_llm(tiny_llama_dir, async_scheduling=True)
    got = llm.generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == tokens[:tokens.index(stop) + 1]
    assert _summary(got) == _summary(sync)
    assert blocks_all_free(llm)


def test_preemption_with_a_step_in_flight_keeps_the_tokens(tiny_llama_dir):
    prompts = random_prompts(12, seed=3, lo=20, hi=40)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=35, ignore_eos=True)
              for i in range(12)]
    big = tiny_llm(tiny_llama_dir, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    small = tiny_llm(tiny_llama_dir, async_scheduling=True, num_gpu_blocks_override=24,
                 enable_prefix_caching=False)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in big]
    assert blocks_all_free(small)


def test_penalties_fall_back_to_one_step_at_a_time(tiny_llama_dir):
    prompts = random_prompts(6, seed=4, lo=5, hi=30)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.3 if i == 2 else 1.0,
                             min_tokens=5 if i == 4 else 0) for i in range(6)]
    sync = tiny_llm(tiny_llama_dir, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    llm = tiny_llm(tiny_llama_dir, async_scheduling=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(sync)
    assert not llm.llm_engine.core._history_requests
    assert blocks_all_free(llm)


def test_abort_with_a_step_in_flight(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, async_scheduling=True)
    eng = llm.llm_engine
    prompts = random_prompts(4, seed=5, lo=8, hi=20)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    finals = {}
    for step in range(200):
        if not eng.has_unfinished_requests():
            break
        if step == 4:
            assert eng.core.queue  # a step in flight
            eng.abort_request("r1")
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    assert {"r0", "r2", "r3"} <= set(finals)
    assert "r1" not in finals or finals["r1"].outputs[0].finish_reason == "abort"
    ref = tiny_llm(tiny_llama_dir, async_scheduling=False).generate(
        [prompts[0], prompts[2], prompts[3]], params, use_tqdm=False)
    assert [finals[r].outputs[0].token_ids for r in ("r0", "r2", "r3")] == [
        o.outputs[0].token_ids for o in ref]
    assert blocks_all_free(llm)

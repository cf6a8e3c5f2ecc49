"""The whole engine on a tiny random checkpoint: preemption, parallel sampling, many mixed
requests, prefix caching, priorities and bad input."""

from __future__ import annotations

import random

import pytest
from engine_helpers import blocks_all_free, random_prompts, tiny_llm

from shoal import SamplingParams
from shoal.core.errors import ErrorCode
from shoal.engine.request_errors import EngineRequestError


def test_preemption_gives_the_tokens_of_a_large_pool(tiny_llama_dir):
    prompts = random_prompts(12, seed=3, lo=20, hi=40)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = tiny_llm(tiny_llama_dir).generate(prompts, params, use_tqdm=False)
    small_llm = tiny_llm(tiny_llama_dir, num_gpu_blocks_override=24, enable_prefix_caching=False)
    small = small_llm.generate(prompts, params, use_tqdm=False)
    assert small_llm.llm_engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in big]
    assert blocks_all_free(small_llm)


def test_preemption_keeps_seeded_sampling_reproducible(tiny_llama_dir):
    prompts = random_prompts(8, seed=4, lo=20, hi=40)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(8)]
    big = tiny_llm(tiny_llama_dir).generate(prompts, params, use_tqdm=False)
    small_llm = tiny_llm(tiny_llama_dir, num_gpu_blocks_override=20, enable_prefix_caching=False)
    small = small_llm.generate(prompts, params, use_tqdm=False)
    assert small_llm.llm_engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in big]


def test_parallel_sampling_with_seed_is_reproducible(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    prompt = random_prompts(1, seed=5, lo=30, hi=31)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    a = llm.generate(prompt, params, use_tqdm=False)[0]
    b = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(a.outputs) == 3
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3  # the samples differ
    # The second run finds the prompt's full blocks cached.
    assert b.num_cached_tokens >= 28


def test_samples_share_the_prompt_blocks(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    eng = llm.llm_engine
    prompt = random_prompts(1, seed=6, lo=40, hi=41)[0]
    eng.add_request("x", prompt, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=8))
    eng.step()  # prefill of all four samples in one step
    kv = eng.core.scheduler.kv
    tables = [kv.block_ids(f"{i}_x") for i in range(4)]
    shared = set(tables[0][:10])  # 40 tokens = 10 full blocks of 4
    assert all(set(t[:9]) <= shared for t in tables[1:])
    while eng.has_unfinished_requests():
        eng.step()
    assert blocks_all_free(llm)


def test_200_random_requests_all_finish_and_free_every_block(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, num_gpu_blocks_override=160, max_num_batched_tokens=64,
               max_num_seqs=32)
    rng = random.Random(7)
    prompts = random_prompts(200, seed=8, lo=1, hi=80)
    # Shared prefixes exercise the prefix cache under eviction.
    base = prompts[0]["prompt_token_ids"]
    for p in prompts[::5]:
        p["prompt_token_ids"] = base[:40] + p["prompt_token_ids"][:20]
    params = [
        SamplingParams(
            n=rng.choice([1, 1, 2]),
            temperature=rng.choice([0.0, 0.8]),
            top_k=rng.choice([0, 20]),
            seed=rng.choice([None, rng.randrange(100)]),
            max_tokens=rng.randrange(1, 40),
            stop_token_ids=[rng.randrange(3, 512)],
            presence_penalty=rng.choice([0.0, 0.5]),
            logprobs=rng.choice([None, 2]),
        )
        for _ in prompts
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 200
    for o, sp in zip(outs, params):
        assert o.finished and len(o.outputs) == sp.n
        for c in o.outputs:
            assert c.finish_reason in ("stop", "length")
            assert 1 <= len(c.token_ids) <= sp.max_tokens
    assert blocks_all_free(llm)


def test_prefix_cache_hit_gives_the_same_tokens(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    prompt = random_prompts(1, seed=9, lo=50, hi=51)[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48  # 12 full blocks of 4; the last token is recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    uncached = tiny_llm(tiny_llama_dir, enable_prefix_caching=False).generate(prompt, params, use_tqdm=False)[0]
    assert uncached.outputs[0].token_ids == first.outputs[0].token_ids


def test_cache_salt_keeps_tenants_apart(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    eng = llm.llm_engine
    prompt = random_prompts(1, seed=10, lo=30, hi=31)[0]["prompt_token_ids"]
    params = SamplingParams(temperature=0, max_tokens=2)
    outs = {}
    for rid, salt in [("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a")]:
        eng.add_request(rid, prompt, params, cache_salt=salt)
        while eng.has_unfinished_requests():
            for o in eng.step():
                outs[o.request_id] = o
    assert outs["a"].num_cached_tokens == 0
    assert outs["b"].num_cached_tokens == 0
    assert outs["c"].num_cached_tokens == 28


def test_priority_policy_runs_urgent_requests_first(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, max_num_seqs=1, scheduling_policy="priority")
    eng = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, prio in [("low", 5), ("high", -1), ("mid", 0)]:
        eng.add_request(rid, [5, 6, 7], params, priority=prio)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["high", "mid", "low"]


def test_stop_token_ids_and_min_tokens(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    prompt = random_prompts(1, seed=11, lo=10, hi=11)[0]
    free_run = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = free_run[5]
    first = free_run.index(stop_tok)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    later = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 1,
                                                stop_token_ids=[stop_tok], ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(later.token_ids) > first + 1  # the stop token was masked until min_tokens


BAD_PARAMS = [
    dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=1.5),
    dict(n=0), dict(presence_penalty=3.0), dict(frequency_penalty=-2.5),
    dict(repetition_penalty=0.0), dict(max_tokens=0), dict(min_tokens=-1),
    dict(min_tokens=5, max_tokens=2), dict(logprobs=-2),
    dict(prompt_logprobs=-2), dict(logit_bias={1: 500.0}), dict(stop_token_ids=[-1]),
    dict(seed="x"), dict(temperature="hot"), dict(n=1.5), dict(stop=["."], detokenize=False),
]


@pytest.mark.parametrize("bad", BAD_PARAMS, ids=lambda d: ",".join(d))
def test_out_of_range_sampling_fields_name_the_field(bad):
    with pytest.raises(ValueError) as err:
        SamplingParams(**bad)
    assert next(iter(bad)) in str(err.value)


def test_bad_input_raises_and_engine_keeps_serving(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, max_model_len=64)
    good = {"prompt_token_ids": [5, 6, 7]}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids
    cases = [
        ({"prompt_token_ids": []}, "empty"),
        ("", "empty"),
        ({"prompt_token_ids": [5] * 64}, "max_model_len"),
        ({"prompt_token_ids": [5, 512]}, "[0, 512)"),
        ({"prompt_token_ids": [5, -1]}, "[0, 512)"),
        ({"prompt_token_ids": [5, "a"]}, "integers"),
    ]
    for prompt, fragment in cases:
        with pytest.raises(ValueError) as err:
            llm.generate(prompt, params, use_tqdm=False)
        assert fragment in str(err.value)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(good, SamplingParams(logit_bias={9999: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):  # the engine's cap, offline too
        llm.generate(good, SamplingParams(logprobs=1000), use_tqdm=False)
    # A bad prompt in a batch rejects the batch before any of it runs.
    with pytest.raises(ValueError):
        llm.generate([good, {"prompt_token_ids": [-5]}], params, use_tqdm=False)
    assert blocks_all_free(llm)
    assert llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_request_larger_than_the_pool_is_rejected(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=50), use_tqdm=False)


def test_non_finite_logits_fail_only_that_request_and_publish_nothing(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    eng = llm.llm_engine
    runner = eng.core.runner
    real = runner.model.compute_logits
    poison = {"on": True}

    def compute_logits(hidden):
        logits = real(hidden)
        if poison["on"]:
            logits[0] = float("nan")
        return logits

    runner.model.compute_logits = compute_logits
    prompt = random_prompts(1, seed=12, lo=30, hi=31)[0]
    with pytest.raises(EngineRequestError, match="non-finite") as failed:
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert failed.value.code == ErrorCode.NON_FINITE
    (out,) = failed.value.outputs  # the batch's outputs ride on the error
    assert out.outputs[0].finish_reason == "error" and out.error_code == ErrorCode.NON_FINITE
    assert blocks_all_free(llm)
    # Nothing it computed may be served from the prefix cache, and the engine keeps serving.
    poison["on"] = False
    again = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].finish_reason == "length"


def test_start_up_warm_requests_leave_no_trace(tiny_llama_dir):
    from shoal.engine.warm_requests import warm_request_path

    llm = tiny_llm(tiny_llama_dir)
    core = llm.llm_engine.core
    warm_request_path(core)  # what a GPU start-up runs before reporting ready
    assert blocks_all_free(llm)
    assert not core.scheduler.kv.pool.cached
    stats = core.scheduler.stats()
    assert stats.prefix_cache_queries == 0 and stats.num_generation_tokens == 0
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].request_id == "0" and out[0].num_cached_tokens == 0

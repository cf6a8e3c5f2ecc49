"""Faults inside the engine core (issue 18, item 4): an exception while running one request
fails only that request, and the engine keeps serving; non-finite logits fail the request
and leave none of its KV blocks in the prefix cache or the KV tiers."""

from __future__ import annotations

import pytest
from engine_helpers import blocks_all_free, nan_logits_for, random_prompts, tiny_llm

from shoal import SamplingParams
from shoal.kv_cache.hashing import hash_full_blocks
from shoal.sample.sampling_metadata import SamplingMetadata

POISON_SEED = 4242  # a request with this seed makes the runner raise (injected below)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _poison_sampling(monkeypatch) -> list[int]:
    """SamplingMetadata.build raises for any step holding a POISON_SEED request; returns a
    list counting the raises."""
    real = SamplingMetadata.build
    raised: list[int] = []

    def build(params_list, *args, **kwargs):
        if any(p.seed == POISON_SEED for p in params_list):
            raised.append(len(params_list))
            raise RuntimeError("injected fault in sampling")
        return real(params_list, *args, **kwargs)

    monkeypatch.setattr(SamplingMetadata, "build", staticmethod(build))
    return raised


def _run(eng, max_steps: int = 1000) -> dict:
    finals: dict = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return finals
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("did not finish")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_exception_in_one_request_fails_only_that_request(tiny_llama_dir, monkeypatch,
                                                             async_scheduling):
    prompts = random_prompts(4, seed=21, lo=6, hi=30)
    ref = tiny_llm(tiny_llama_dir).generate(prompts[:3], GREEDY, use_tqdm=False)
    raised = _poison_sampling(monkeypatch)
    llm = tiny_llm(tiny_llama_dir, async_scheduling=async_scheduling)
    eng = llm.llm_engine
    for i in range(3):
        eng.add_request(f"ok{i}", prompts[i], GREEDY)
    eng.add_request("bad", prompts[3], SamplingParams(temperature=1.0, seed=POISON_SEED,
                                                      max_tokens=10, ignore_eos=True))
    finals = _run(eng)
    assert len(raised) == 2  # in the batch, then alone
    assert raised[-1] == 1
    bad = finals["bad"]
    assert bad.outputs[0].finish_reason == "error" and "injected fault" in bad.error
    for i in range(3):  # the others rerun (alone first) and answer as if nothing happened
        assert finals[f"ok{i}"].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert blocks_all_free(llm)
    again = llm.generate(prompts[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert again == ref[0].outputs[0].token_ids  # and the engine keeps serving


def test_a_request_alone_in_a_failing_step_fails_at_once(tiny_llama_dir, monkeypatch):
    raised = _poison_sampling(monkeypatch)
    llm = tiny_llm(tiny_llama_dir)
    eng = llm.llm_engine
    eng.add_request("bad", random_prompts(1, seed=22)[0],
                    SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=5))
    finals = _run(eng)
    assert raised == [1] and finals["bad"].outputs[0].finish_reason == "error"
    assert blocks_all_free(llm)


def test_nan_logits_fail_the_request_and_publish_no_kv_blocks(tiny_llama_dir):
    bad_prompt, other = random_prompts(2, seed=23, lo=20, hi=30)
    ref = tiny_llm(tiny_llama_dir).generate([bad_prompt, other], GREEDY, use_tqdm=False)
    llm = tiny_llm(tiny_llama_dir, kv_offloading_size=64 * 2048 / 2**30)
    eng = llm.llm_engine
    hits = nan_logits_for(eng.core.runner, "bad")
    eng.add_request("bad", bad_prompt, GREEDY)
    eng.add_request("other", other, GREEDY)
    finals = _run(eng)
    assert hits and finals["bad"].outputs[0].finish_reason == "error"
    assert "non-finite" in finals["bad"].error
    assert finals["other"].outputs[0].token_ids == ref[1].outputs[0].token_ids
    sched = eng.core.scheduler
    hashes = hash_full_blocks(bad_prompt["prompt_token_ids"], 4, [])
    assert not any(sched.kv.pool.get_cached_block(h) for h in hashes)
    store = eng.core.kv_offload
    from shoal.kv_offload.control import offload_device_prefix_cache
    offload_device_prefix_cache(eng.core)  # whatever the device cache holds goes to the CPU
    assert not any(store.cpu.contains(h) for h in hashes)
    del eng.core.runner.sample  # the class's own again
    out = llm.generate(bad_prompt, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # recomputed: nothing of the failed run was kept
    assert out.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert blocks_all_free(llm)


# ---- faults while scheduling ------------------------------------------------------------------


def _poison_scheduling(monkeypatch, where: str, bad_id: str, after_tokens: int = 0
                       ) -> list[str]:
    """Makes the scheduler raise while handling request `bad_id` (admission: looking up its
    cached prefix; running: allocating its next blocks once it has after_tokens outputs;
    build: making its step item). Returns the places it raised."""
    from shoal.engine.admission import Admission
    from shoal.engine.scheduler import Scheduler
    from shoal.kv_cache.manager import KVCacheManager

    raised: list[str] = []
    if where == "admission":
        real = Admission.find_cached

        def find_cached(self, req):
            if req.request_id == bad_id:
                raised.append(where)
                raise KeyError("injected fault in admission")
            return real(self, req)

        monkeypatch.setattr(Admission, "find_cached", find_cached)
    elif where == "running":
        real_alloc = KVCacheManager.allocate_slots

        def allocate_slots(self, request, *args, **kwargs):
            if request.request_id == bad_id and request.num_output_tokens >= after_tokens:
                raised.append(where)
                raise IndexError("injected fault in allocation")
            return real_alloc(self, request, *args, **kwargs)

        monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate_slots)
    else:
        real_item = Scheduler._scheduled_item

        def scheduled_item(self, req, n):
            if req.request_id == bad_id and req.num_output_tokens >= after_tokens:
                raised.append(where)
                raise ValueError("injected fault in building the step")
            return real_item(self, req, n)

        monkeypatch.setattr(Scheduler, "_scheduled_item", scheduled_item)
    return raised


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("where,after", [("admission", 0), ("running", 3), ("build", 0),
                                         ("build", 4)])
def test_a_fault_while_scheduling_one_request_fails_only_it(tiny_llama_dir, monkeypatch,
                                                            where, after, async_scheduling):
    """The scheduler raising on one request (a bug) ends that request with the error; the
    step is rolled back, so the others are scheduled again and answer as without it, and the
    engine neither stops nor spins on the same fault."""
    prompts = random_prompts(4, seed=31, lo=6, hi=30)
    ref = tiny_llm(tiny_llama_dir).generate(prompts[:3], GREEDY, use_tqdm=False)
    raised = _poison_scheduling(monkeypatch, where, "bad", after)
    llm = tiny_llm(tiny_llama_dir, async_scheduling=async_scheduling)
    eng = llm.llm_engine
    eng.add_request("ok0", prompts[0], GREEDY)
    eng.add_request("bad", prompts[3], GREEDY)
    for i in (1, 2):
        eng.add_request(f"ok{i}", prompts[i], GREEDY)
    finals = _run(eng)
    assert raised == [where]
    bad = finals["bad"]
    assert bad.outputs[0].finish_reason == "error" and "injected fault" in bad.error
    for i in range(3):
        assert finals[f"ok{i}"].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert blocks_all_free(llm)

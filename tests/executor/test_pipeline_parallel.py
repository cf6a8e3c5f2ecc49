"""Pipeline parallelism on the mp executor (issue 13, item 3), on the CPU with gloo: each
stage builds and loads only its decoder layers, the stages pass (hidden, residual) to each
other and the last one sends its final hidden states back to rank 0, which samples. Up to
pipeline_parallel_size steps are in flight (micro-batches of disjoint requests). The tokens
(and logprobs) equal one rank's; what is not supported yet is refused clearly."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from engine_helpers import blocks_all_free
from executor.worker_checks import (
    StepLog,
    assert_close,
    assert_kill_fails_step,
    generate_outputs,
    served_tokens,
)
from oracle import write_tiny_checkpoint

from shoal import LLM, SamplingParams
from shoal.config import ParallelConfig
from shoal.distributed.parallel_state import get_pp_indices, pp_layer_partition
from shoal.engine.engine_args import EngineArgs
from shoal.models.llama import PPMissingLayer
from shoal.worker.warmup import dummy_forward

PROMPTS = [[5, 17, 300, 42, 7, 99], [256, 3, 11, 400, 23, 8, 1, 2, 3, 4, 5, 6, 7], [9, 9, 9]]


def _tiny_llm(path: str, **kwargs) -> LLM:
    args = {"num_gpu_blocks_override": 64, **kwargs}
    return LLM(model=path, device="cpu", dtype="float32", max_model_len=128,
               enable_prefix_caching=False, **args)


def test_layer_split_follows_vllm():
    # contiguous, the remainder on the stages before the last one
    assert [get_pp_indices(30, r, 2) for r in range(2)] == [(0, 15), (15, 30)]
    assert [get_pp_indices(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [get_pp_indices(7, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 7)]


def test_an_uneven_layer_split_matches_one_rank(tmp_path, monkeypatch):
    """SHOAL_PP_LAYER_PARTITION=1,3 on a 4-layer Llama (evenly: 2 + 2): stage 0 builds,
    loads and caches one layer, stage 1 three; the pool is as many blocks as the 3-layer
    stage can hold; tokens and logprobs equal one rank's."""
    torch.set_num_threads(1)
    path = str(write_tiny_checkpoint(tmp_path / "llama4", "llama", num_hidden_layers=4))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    llm = _tiny_llm(path)
    try:
        one = generate_outputs(llm, prompts, params)
    finally:
        llm.shutdown()
    monkeypatch.setenv("SHOAL_PP_LAYER_PARTITION", "1,3")
    budget = 1 << 20
    llm = _tiny_llm(path, pipeline_parallel_size=2, num_gpu_blocks_override=None,
                    kv_cache_memory_bytes=budget)
    try:
        driver = llm.llm_engine.core.runner.driver
        model = driver.model.model
        assert (model.start_layer, model.end_layer) == (0, 1)
        assert all(isinstance(layer, PPMissingLayer) for layer in model.layers[1:])
        assert not any(n.startswith("model.layers.1.") for n, _ in driver.model.named_parameters())
        assert len(driver.kv_caches) == 1
        one_layer = driver.kv_specs[0].page_bytes(driver.block_size)
        assert driver.null_block == budget // (3 * one_layer)  # the later stage's 3 layers
        pp = generate_outputs(llm, prompts, params)
    finally:
        llm.shutdown()
    assert_close(one, pp, 1e-4)


@pytest.mark.parametrize("value", ["2,1", "1", "1,1,1", "0,2", "1;1", "a,b", "1,1,"])
def test_a_bad_layer_partition_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("SHOAL_PP_LAYER_PARTITION", value)
    with pytest.raises(ValueError, match=r"SHOAL_PP_LAYER_PARTITION='.*' is invalid: it must "
                                         r"be 2 comma-separated integers, one layer count per "
                                         r"pipeline stage, each >= 1, that sum to the model's "
                                         r"2 decoder layers"):
        EngineArgs(device="cpu", pipeline_parallel_size=2).create_engine_config(Hf())


def test_layer_partition_values(monkeypatch):
    assert pp_layer_partition(30, 2) is None  # unset: the even split
    monkeypatch.setenv("SHOAL_PP_LAYER_PARTITION", " 13, 17 ")
    assert pp_layer_partition(30, 2) == [13, 17]
    assert pp_layer_partition(30, 1) is None  # one stage holds every layer
    cfg = EngineArgs(device="cpu", pipeline_parallel_size=2)
    monkeypatch.setenv("SHOAL_PP_LAYER_PARTITION", "1,1")
    assert cfg.create_engine_config(Hf()).parallel_config.pipeline_parallel_size == 2


def test_smollm2_two_stages_match_one_rank(smollm_llm):
    torch.set_num_threads(1)
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, prompt_logprobs=2)
    one = generate_outputs(smollm_llm, prompts, params)
    llm = LLM(pipeline_parallel_size=2, max_model_len=256, kv_cache_memory_bytes=32 << 20)
    try:
        runner = llm.llm_engine.core.runner
        assert type(runner).__name__ == "MultiprocExecutor" and runner.world == 2
        model = runner.driver.model
        # Stage 0 of SmolLM2's 30 layers: the first 15, the embedding (tied: also lm_head).
        assert (model.model.start_layer, model.model.end_layer) == (0, 15)
        assert all(isinstance(layer, PPMissingLayer) for layer in model.model.layers[15:])
        assert isinstance(model.model.norm, PPMissingLayer)
        assert not any(n.startswith(("model.layers.15.", "model.norm."))
                       for n, _ in model.named_parameters())
        assert len(runner.driver.kv_caches) == 15
        pp = generate_outputs(llm, prompts, params)
    finally:
        llm.shutdown()
    assert_close(one, pp, 1e-4)


def test_tiny_models_two_stages_and_tensor_parallel_match_one_rank(tmp_path):
    """A 2-layer Llama over 2 stages x 2 TP ranks (4 processes), a 3-layer Qwen3 over 2
    stages (split 2 + 1): greedy and seeded sampling, logprobs, equal to one rank."""
    torch.set_num_threads(1)
    llama = str(write_tiny_checkpoint(tmp_path / "llama", "llama"))
    qwen3 = str(write_tiny_checkpoint(tmp_path / "qwen3", "qwen3", num_hidden_layers=3))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    for path, kwargs in ((llama, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
                         (qwen3, {"pipeline_parallel_size": 2})):
        llm = _tiny_llm(path)
        try:
            one = [generate_outputs(llm, prompts, p) for p in (greedy, seeded)]
        finally:
            llm.shutdown()
        llm = _tiny_llm(path, **kwargs)
        try:
            runner = llm.llm_engine.core.runner
            world = kwargs.get("tensor_parallel_size", 1) * 2
            assert runner.world == world and len(runner._procs) == world - 1
            tp = kwargs.get("tensor_parallel_size", 1)
            full = runner.driver.hf_config.num_attention_heads
            assert runner.driver.model.attention_layers()[0].num_heads * tp == full
            layers = runner.driver.model.model.layers
            assert len(runner.driver.kv_caches) == len(layers) - len(layers) // 2
            pp = [generate_outputs(llm, prompts, p) for p in (greedy, seeded)]
        finally:
            llm.shutdown()
        for a, b in zip(one, pp):
            assert_close(a, b, 1e-4)


def test_serve_with_two_stages_answers_like_one(tiny_llama_dir):
    llm = _tiny_llm(str(tiny_llama_dir))
    try:
        expected = generate_outputs(llm, [{"prompt_token_ids": PROMPTS[0]}],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0][0]
    finally:
        llm.shutdown()
    assert served_tokens(str(tiny_llama_dir), ["--pipeline-parallel-size", "2"],
                         PROMPTS[0]) == expected


def test_two_micro_batches_are_in_flight_and_match_one_rank(tiny_llama_dir):
    """Stage 0 launches micro-batch N+1 before it finishes N; the steps in flight hold
    disjoint requests; tokens and logprobs equal one rank's."""
    torch.set_num_threads(1)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(3 + 2 * i)]}
               for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    llm = _tiny_llm(str(tiny_llama_dir))
    try:
        one = generate_outputs(llm, prompts, params)
    finally:
        llm.shutdown()
    llm = _tiny_llm(str(tiny_llama_dir), pipeline_parallel_size=2)
    try:
        log = StepLog(llm.llm_engine.core.runner)
        pp = generate_outputs(llm, prompts, params)
        events = "".join(log.events)
        assert log.most == 2 and events.startswith("LLF")
        # Decodes alternate between the two halves: each finish lets the next launch in.
        assert "LFLFLFLF" in events
        assert blocks_all_free(llm)
    finally:
        llm.shutdown()
    assert_close(one, pp, 1e-4)


def test_three_stages_and_an_abort_with_its_step_in_flight(tmp_path):
    """Three stages, three micro-batches: a request aborted while its step is in flight has
    its runner state dropped before that step is finished; the step still samples it (and
    the scheduler drops the result), the others' tokens equal one rank's."""
    torch.set_num_threads(1)
    path = str(write_tiny_checkpoint(tmp_path / "llama3", "llama", num_hidden_layers=3))
    prompts = [{"prompt_token_ids": [(5 * i + j) % 500 + 3 for j in range(4 + i)]}
               for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = _tiny_llm(path)
    try:
        one = generate_outputs(llm, prompts, params)
    finally:
        llm.shutdown()
    llm = _tiny_llm(path, pipeline_parallel_size=3)
    try:
        engine = llm.llm_engine
        log = StepLog(engine.core.runner)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        engine.step()
        engine.step()  # two micro-batches in flight: "0", "1" then "2", "3"
        assert len(engine.core.queue) == 2
        engine.abort_request("2")
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        assert log.most == 3
        done.pop("2", None)
        assert done == {str(i): one[i][0] for i in (0, 1, 3, 4, 5)}
        assert blocks_all_free(llm)
    finally:
        llm.shutdown()


def test_preemption_under_a_small_pool_gives_the_same_tokens(tiny_llama_dir):
    torch.set_num_threads(1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [[4, 8, 15, 16, 23, 42] * 2]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # 8 blocks of 16 tokens for 4 requests of up to 53 tokens (4 blocks each)
    llm = _tiny_llm(str(tiny_llama_dir), num_gpu_blocks_override=8)
    try:
        one = generate_outputs(llm, prompts, params)
    finally:
        llm.shutdown()
    llm = _tiny_llm(str(tiny_llama_dir), num_gpu_blocks_override=8, pipeline_parallel_size=2)
    try:
        log = StepLog(llm.llm_engine.core.runner)
        pp = generate_outputs(llm, prompts, params)
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
        assert log.most == 2
        assert blocks_all_free(llm)
    finally:
        llm.shutdown()
    assert [ids for ids, _, _ in pp] == [ids for ids, _, _ in one]


def test_a_killed_stage_fails_the_requests_in_flight(tiny_llama_dir):
    torch.set_num_threads(1)
    llm = _tiny_llm(str(tiny_llama_dir), pipeline_parallel_size=2)
    try:
        engine = llm.llm_engine
        proc = engine.core.runner._procs[0]
        # The GPU's warm-up / profile forward on stage 0 (no peer involved): its
        # (hidden, residual) stands in for the final hidden states.
        dummy_forward(engine.core.runner.driver, [5, 3], 0)
        assert_kill_fails_step(engine, lambda: os.kill(proc.pid, signal.SIGKILL), PROMPTS,
                               max_tokens=100)
    finally:
        llm.shutdown()


class Hf:
    architectures = ["LlamaForCausalLM"]
    model_type = "llama"
    vocab_size = 512
    max_position_embeddings = 128
    num_hidden_layers = 2


class HfMoe(Hf):
    architectures = ["Qwen3MoeForCausalLM"]
    model_type = "qwen3_moe"


class HfOneLayer(Hf):
    num_hidden_layers = 1


@pytest.mark.parametrize("kwargs, hf, message", [
    ({"pipeline_parallel_size": 0}, Hf, "pipeline_parallel_size must be an integer >= 1"),
    ({"distributed_executor_backend": "uni"}, Hf, "needs distributed_executor_backend 'mp'"),
    ({"async_scheduling": True}, Hf, "async_scheduling does not support pipeline"),
    ({"kv_offloading_size": 1.0}, Hf, "kv_offloading_size does not support pipeline"),
    ({}, HfMoe, "not Qwen3MoeForCausalLM yet"),
    ({}, HfOneLayer, "needs at least as many decoder layers"),
])
def test_unsupported_pipeline_parallel_settings_are_refused(kwargs, hf, message):
    args = {"device": "cpu", "pipeline_parallel_size": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        EngineArgs(**args).create_engine_config(hf())


def test_cuda_graphs_and_the_uni_executor_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="does not support CUDA graphs yet: pass enforce_eager"):
        EngineArgs(device="cuda", pipeline_parallel_size=2).create_engine_config(Hf())
    with pytest.raises(ValueError, match="needs distributed_executor_backend 'mp'"):
        ParallelConfig(pipeline_parallel_size=2)  # the default backend: uni
    cfg = EngineArgs(device="cpu", pipeline_parallel_size=2).create_engine_config(Hf())
    pc = cfg.parallel_config
    assert (pc.distributed_executor_backend, pc.world_size, cfg.async_scheduling) == (
        "mp", 2, False)

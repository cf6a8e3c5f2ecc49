"""The weights' copies on side streams, on a real GPU (skipped without one), CUDA graphs on:
- weight offloading with prefetch (layer k+1 copied while layer k computes, two staging
  slots: shoal/loader/offload_copies.py) gives the tokens and logprobs of offloading without
  prefetch and of the plain engine, over eager prefills and graph-replayed decodes, through
  sleep / wake and a weight update;
- level-1 sleep's pinned host buffers are reused by the next sleep (same addresses, none
  allocated), and a wake-up's asynchronous copies land before anything queued after it reads
  the weights (a checksum right after wake_up, with no synchronization in between).

    .venv/bin/python -m pytest -q tests/rl/test_weight_copies_gpu.py"""

from __future__ import annotations

import gc

import pytest
import torch
from bf16_runs import greedy_outputs, same
from oracle import write_tiny_checkpoint
from safetensors.torch import load_file

from shoal import LLM, SamplingParams
from shoal.loader.weight_offload import WeightOffloader, layer_layout, offloader_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# ~34 MB of bfloat16 weights a layer: a copy takes longer than the layer's compute
SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
             max_position_embeddings=1024)
ENGINE = dict(dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3)
# a long prompt (an eager prefill), a batch of short ones (decode steps from CUDA graphs)
PROMPTS = ([{"prompt_token_ids": [(7 * i) % 1000 + 3 for i in range(300)]}]
           + [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(7)])
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def outputs(llm: LLM) -> list[tuple[list[int], list[list[float]]]]:
    return greedy_outputs(llm, PROMPTS, GREEDY)


def close(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("copies"), "llama", **SHAPE))


def offloaded(path: str, prefetch: bool, budget: int, updated: dict) -> tuple[list, list]:
    """Outputs of an engine offloading `budget` bytes, before and after an update to
    `updated` (with sleep / wake cycles on the way)."""
    WeightOffloader.default_prefetch = prefetch
    try:
        llm = LLM(model=path, cpu_offload_gb=budget / 2**30, **ENGINE)
    finally:
        WeightOffloader.default_prefetch = None
    try:
        runner = llm.llm_engine.core.runner
        off = offloader_of(runner.model)
        assert off.prefetch is prefetch and off.copies.prefetch is prefetch
        assert runner.graphs is not None  # replays copy the layers in
        layers = runner.model.model.layers
        slot = max(layer_layout(list(layers[i].parameters()))[1] for i in range(4))
        assert len(off.stats.layers) == 4
        assert off.stats.staging_bytes == (2 if prefetch else 1) * slot
        second = next(layers[1].parameters()).data_ptr() - off.staging.data_ptr()
        assert second == (slot if prefetch else 0)
        before = outputs(llm)
        for _ in range(2):
            llm.sleep(level=1)
            llm.wake_up()
            assert same(outputs(llm), before)
        llm.update_weights(updated)
        return before, outputs(llm)
    finally:
        close(llm)


def test_prefetch_gives_the_tokens_of_no_prefetch(checkpoint) -> None:
    updated = {k: v * 1.5 if v.dim() == 2 else v
               for k, v in load_file(f"{checkpoint}/model.safetensors").items()}
    plain = LLM(model=checkpoint, **ENGINE)
    want = outputs(plain)
    sizes = [layer_layout(list(layer.parameters()))[1]
             for layer in plain.llm_engine.core.runner.model.model.layers]
    plain.update_weights(updated)
    want_updated = outputs(plain)
    close(plain)
    assert not same(want, want_updated)
    budget = sum(sizes[:4]) + sizes[4] // 2  # four whole layers
    without = offloaded(checkpoint, False, budget, updated)
    with_prefetch = offloaded(checkpoint, True, budget, updated)
    assert same(with_prefetch[0], without[0]) and same(with_prefetch[1], without[1])
    assert same(with_prefetch[0], want) and same(with_prefetch[1], want_updated)


def test_sleep_reuses_pinned_buffers_and_wake_orders_its_copies(checkpoint) -> None:
    llm = LLM(model=checkpoint, **ENGINE)
    try:
        runner = llm.llm_engine.core.runner
        want, checksum = outputs(llm), llm.collective_rpc("weights_checksum")[0]
        assert llm.sleep(1)["host_buffers_allocated"] > 0
        host = runner.host_copies
        assert all(b.is_pinned() for b in host.buffers)
        ptrs = [b.data_ptr() for b in host.buffers]
        llm.wake_up(["weights"])
        # queued right behind the copies: it must see the weights, not what the allocator
        # handed back
        assert llm.collective_rpc("weights_checksum")[0] == checksum
        llm.wake_up(["kv_cache"])
        assert same(outputs(llm), want)
        for _ in range(3):
            assert llm.sleep(1)["host_buffers_allocated"] == 0
            assert [b.data_ptr() for b in host.buffers] == ptrs
            llm.wake_up()
            assert same(outputs(llm), want)
        llm.sleep(2)
        assert host.buffers == []
        llm.wake_up()
    finally:
        close(llm)

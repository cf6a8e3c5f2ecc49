"""The scheduler limits a CPU engine gets without flags: a token budget that scales with the
model's threads (so a burst of prompts prefills in short steps), the user's values always
winning, and a whole prompt per step when chunked prefill is off."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.cpu_defaults import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    GPU_MAX_NUM_BATCHED_TOKENS,
    GPU_MAX_NUM_SEQS,
    default_scheduler_limits,
)
from shoal.engine.engine_args import EngineArgs


def test_cpu_budget_scales_with_threads_within_bounds():
    one = default_scheduler_limits("cpu", 1, 2048, True)
    two = default_scheduler_limits("cpu", 2, 2048, True)
    many = default_scheduler_limits("cpu", 256, 2048, True)
    assert one.max_num_batched_tokens < two.max_num_batched_tokens
    assert two.max_num_batched_tokens == 2 * one.max_num_batched_tokens
    assert many.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS
    assert default_scheduler_limits("cpu", 0, 2048, True).max_num_batched_tokens >= 1
    assert one.max_num_seqs == CPU_MAX_NUM_SEQS


def test_offline_cpu_keeps_large_steps():
    lim = default_scheduler_limits("cpu", 2, 2048, True, serving=False)
    assert (lim.max_num_batched_tokens, lim.max_num_seqs) == (GPU_MAX_NUM_BATCHED_TOKENS,
                                                              CPU_MAX_NUM_SEQS)


def test_gpu_keeps_the_large_defaults():
    lim = default_scheduler_limits("cuda", 1, 2048, True)
    assert (lim.max_num_batched_tokens, lim.max_num_seqs) == (GPU_MAX_NUM_BATCHED_TOKENS,
                                                              GPU_MAX_NUM_SEQS)


def test_user_values_win_and_unchunked_prefill_fits_a_prompt():
    lim = default_scheduler_limits("cpu", 2, 2048, True, max_num_batched_tokens=100,
                                   max_num_seqs=3)
    assert (lim.max_num_batched_tokens, lim.max_num_seqs) == (100, 3)
    assert default_scheduler_limits("cpu", 1, 8192, False).max_num_batched_tokens == 8192


class _Cfg:
    vocab_size = 100
    max_position_embeddings = 4096


@pytest.mark.parametrize("threads", [1, 2])
def test_engine_config_uses_the_model_threads(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sc = EngineArgs(device="cpu").create_engine_config(_Cfg(), serving=True).scheduler_config
        expect = default_scheduler_limits("cpu", threads, 4096, True)
        assert sc.max_num_batched_tokens == expect.max_num_batched_tokens
        # Offline (the LLM) keeps large steps: throughput, no first token waiting.
        sc = EngineArgs(device="cpu").create_engine_config(_Cfg()).scheduler_config
        assert sc.max_num_batched_tokens == GPU_MAX_NUM_BATCHED_TOKENS
        sc = EngineArgs(device="cpu", max_num_batched_tokens=77,
                        max_num_seqs=5).create_engine_config(_Cfg()).scheduler_config
        assert (sc.max_num_batched_tokens, sc.max_num_seqs) == (77, 5)
        sc = EngineArgs(device="cpu", enable_chunked_prefill=False, max_model_len=3000
                        ).create_engine_config(_Cfg(), serving=True).scheduler_config
        assert sc.max_num_batched_tokens == 3000
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_on_a_cpu_without_native_bf16_warns(native, monkeypatch, caplog):
    """A bf16 matmul without AVX-512 BF16 / AMX is ~100x slower than fp32: the user is told."""
    import shoal.engine.engine_args as ea

    monkeypatch.setattr(ea, "_cpu_has_bf16_matmul", lambda: native)
    with caplog.at_level("WARNING", logger="shoal.engine.engine_args"):
        EngineArgs(device="cpu", dtype="bfloat16").create_engine_config(_Cfg())
        EngineArgs(device="cpu", dtype="float32").create_engine_config(_Cfg())
    warned = [r for r in caplog.records if "no native bfloat16 matmul" in r.message]
    assert len(warned) == (0 if native else 1)

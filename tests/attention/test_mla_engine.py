"""A tiny DeepSeek-V3 through the whole engine on the Triton attention backend (the MLA
kernels in Triton's interpreter on the CPU, compiled on a GPU): the same greedy tokens and
logprobs as transformers, with decodes and prefill chunks after cached context in one step."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")

from deepseek_tiny import V3, check_against_hf, write_deepseek  # noqa: E402

from shoal import LLM, SamplingParams  # noqa: E402


def test_deepseek_v3_on_the_triton_backend(tmp_path):
    path, hf = write_deepseek(tmp_path / "v3", "deepseek_v3", 1, **V3)
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=24, block_size=16,
              num_gpu_blocks_override=64, max_model_len=256, attention_backend="triton")
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_against_hf(outs, prompts, hf, 5)

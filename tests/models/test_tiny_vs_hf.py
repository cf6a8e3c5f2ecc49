"""shoal's Llama-family models against transformers on the same tiny random checkpoints,
through the whole engine: mixed batches, chunked prefill, paged attention."""

from __future__ import annotations

import random

import pytest
import torch
from oracle import hf_greedy, write_tiny_checkpoint
from transformers import AutoModelForCausalLM

from shoal import LLM, SamplingParams


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def tiny(request, tmp_path_factory):
    extra = {"mistral": {"sliding_window": None},  # llama: every projection biased
             "llama": {"attention_bias": True, "mlp_bias": True}}.get(request.param, {})
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=1, **extra)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def test_greedy_matches_transformers_in_mixed_chunked_batches(tiny):
    arch, path, hf = tiny
    # A small token budget forces chunked prefill and decodes mixed with prefill chunks.
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=24, block_size=4,
              num_gpu_blocks_override=256, max_model_len=256)
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, p, 12)
        got = o.outputs[0]
        assert got.token_ids == ref, arch
        for step, (tok, lg) in enumerate(zip(got.token_ids, ref_logits)):
            want = torch.log_softmax(lg, -1)[tok].item()
            assert got.logprobs[step][tok].logprob == pytest.approx(want, abs=1e-4)
            assert got.logprobs[step][tok].rank == 1


def test_prompt_logprobs_match_transformers(tiny):
    arch, path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=128, max_model_len=256)
    prompt = _prompts(1, seed=5)[0] + [7, 8, 9] * 10
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        top = ref[pos - 1].topk(2).indices.tolist()
        assert all(t in entry for t in top)

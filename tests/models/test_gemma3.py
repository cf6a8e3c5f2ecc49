"""shoal's Gemma3ForCausalLM (the text decoder) against transformers' on a tiny random
checkpoint through the whole engine: 4 layers (3 sliding of window 8, 1 full, each type with
its own rope base), 4 query heads on 2 KV heads of 16, query_pre_attn_scalar 24 (not
head_dim), tied embeddings. Prompts run well past the window, in chunked prefill steps
mixed with decodes, and greedy tokens, their logprobs and the prompt logprobs match."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from oracle import check_against_hf, randomize_weights
from transformers import Gemma3ForCausalLM as HFGemma3
from transformers import Gemma3TextConfig

import shoal.models.registry
from shoal import LLM, SamplingParams
from shoal.models.gemma3 import Gemma3ForCausalLM

WINDOW = 8


def tiny_text_config(vocab_size: int = 256) -> dict:
    """The decoder both tests use (the vision-language test nests it as text_config)."""
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                query_pre_attn_scalar=24, sliding_window=WINDOW,
                layer_types=["sliding_attention"] * 3 + ["full_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 100.0},
                                 "full_attention": {"rope_type": "default",
                                                    "rope_theta": 10000.0}},
                max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, HFGemma3]:
    path = tmp_path_factory.mktemp("gemma3")
    cfg = Gemma3TextConfig(**tiny_text_config(), architectures=["Gemma3ForCausalLM"])
    torch.manual_seed(0)
    hf = HFGemma3(cfg).eval()
    randomize_weights(hf)
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture
def registered(monkeypatch) -> None:
    monkeypatch.setitem(shoal.models.registry._MODELS, "Gemma3ForCausalLM",
                        ("shoal.models.gemma3", "Gemma3ForCausalLM"))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def test_config_sets_what_the_test_relies_on(tiny) -> None:
    _, hf = tiny
    c = hf.config
    assert c.query_pre_attn_scalar ** -0.5 != c.head_dim ** -0.5
    assert c.final_logit_softcapping is None and c.attn_logit_softcapping is None
    assert "lm_head.weight" not in {n for n, _ in hf.named_parameters()}  # tied


def test_greedy_matches_transformers_in_mixed_chunked_batches(tiny, registered) -> None:
    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=256, max_model_len=256)
    prompts = _prompts(5, seed=1) + [[(7 * i) % 250 + 3 for i in range(45)]]
    assert max(map(len, prompts)) > 4 * WINDOW
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = llm.llm_engine.core.runner.model
    assert isinstance(model, Gemma3ForCausalLM)  # not the Transformers backend
    assert [a.sliding_window for a in model.attention_layers()] == [WINDOW] * 3 + [None]
    check_against_hf(outs, prompts, hf, 12)


def test_prompt_logprobs_match_transformers(tiny, registered) -> None:
    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=8, block_size=4,
              num_gpu_blocks_override=128, max_model_len=256)
    prompt = _prompts(1, seed=5)[0] + [9, 10, 11] * 8
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert got == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4), pos


def test_a_prefix_hit_over_the_sliding_groups_gives_the_tokens_of_a_miss(tiny, registered):
    """Its 3 sliding layers beside 1 full one are 3 KV cache groups (kv_cache_spec.py: a
    sliding kind no larger than the full one's): a repeat of a prompt past the window reuses
    the full group's blocks and every sliding group's window, and gives transformers' tokens
    (those of the miss)."""
    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=256, max_model_len=256, enable_prefix_caching=True)
    runner = llm.llm_engine.core.runner
    assert [g.sliding_window for g in runner.kv_groups] == [None] + [WINDOW] * 3
    prompt = [(5 * i) % 250 + 3 for i in range(37)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    miss = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    hit = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert hit[0].num_cached_tokens >= 32
    assert hit[0].outputs[0].token_ids == miss[0].outputs[0].token_ids
    check_against_hf(hit, [prompt], hf, 10)

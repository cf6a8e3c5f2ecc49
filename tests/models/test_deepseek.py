"""DeepSeek-V3 and V2 (multi-head latent attention, DeepSeek MoE) against transformers on tiny
random checkpoints, through the whole engine: grouped routing with the score-correction bias,
shared experts, a dense first layer, YaRN with the softmax mscale, interleaved rotary; chunked
and mixed batches, prefix-cache hits, preemption, the CPU KV tier on latent blocks, two
tensor-parallel ranks; the shipped DeepSeek-V2-Lite and Kimi-K2 shapes."""

from __future__ import annotations

import random

import pytest
import torch
from deepseek_tiny import V2, V3, check_against_hf, write_deepseek
from gloo_harness import load_tp_model, prompt_logits, run_on_two_ranks
from safetensors.torch import load_file
from transformers import AutoConfig

from shoal import LLM, SamplingParams
from shoal.core.kv_cache_spec import LatentAttentionSpec
from shoal.layers.latent_attention import LatentAttention
from shoal.loader import load_model
from shoal.models.deepseek_v2 import DeepseekMLP, DeepseekMoE, DeepseekV2ForCausalLM
from shoal.models.registry import resolve_model_class
from shoal.worker.kv_cache_tensors import layer_specs


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v2"])
def tiny(request, tmp_path_factory):
    kw = V3 if request.param == "deepseek_v3" else V2
    return write_deepseek(tmp_path_factory.mktemp(request.param), request.param, seed=1, **kw)


def _prompts(n: int, seed: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_greedy_matches_transformers_in_mixed_chunked_batches(tiny):
    path, hf = tiny
    # A small token budget: chunked prefill, decodes mixed with prefill chunks.
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=24, block_size=4,
              num_gpu_blocks_override=256, max_model_len=256)
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    check_against_hf(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False),
           prompts, hf, 10)
    alone = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
    check_against_hf(alone, prompts[:1], hf, 10)


def test_prefix_hits_and_preemption(tiny):
    path, hf = tiny
    # 20 blocks of 4 for requests of up to 50 + 12 tokens: requests get preempted.
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks_override=20,
              max_model_len=128, enable_prefix_caching=True)
    shared = _prompts(1, seed=9, lo=30, hi=31)[0]
    prompts = [shared + p for p in _prompts(4, seed=3, lo=2, hi=20)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_against_hf(outs, prompts, hf, 12)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    again = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)
    assert again[0].num_cached_tokens >= 28  # the shared prefix came from the cache
    check_against_hf(again, prompts[1:2], hf, 12)


def test_prompt_logprobs_match_transformers(tiny):
    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=128, max_model_len=256)
    prompt = _prompts(1, seed=5)[0] + [7, 8, 9] * 10
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert got == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)


def test_cpu_kv_tier_on_latent_blocks(tiny):
    """Blocks of one latent plane go to the CPU tier and come back: same tokens as HF."""
    path, hf = tiny
    per_block = 3 * 4 * (32 + 16) * 4  # layers * tokens * latent row * fp32
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_model_len=128,
              num_gpu_blocks_override=24, kv_offloading_size=64 * per_block / 2**30)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    first = _prompts(1, seed=11, lo=40, hi=41)
    llm.generate({"prompt_token_ids": first[0]}, params, use_tqdm=False)
    for other in _prompts(3, seed=12, lo=50, hi=51):  # push it out of the device pool
        llm.generate({"prompt_token_ids": other}, params, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": first[0]}, params, use_tqdm=False)
    hits = {t.name: t.hits for t in llm.llm_engine.core.kv_offload.stats().tiers}
    assert hits["cpu"] > 0 and out[0].num_cached_tokens >= 36
    check_against_hf(out, first, hf, 6)


def test_layers_follow_the_config():
    cfg = AutoConfig.for_model("deepseek_v3", **dict(V3, num_hidden_layers=4,
                                                     first_k_dense_replace=2))
    model = DeepseekV2ForCausalLM(cfg, torch.float32)
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [DeepseekMLP, DeepseekMLP, DeepseekMoE, DeepseekMoE]
    attn = model.attention_layers()
    assert all(isinstance(a, LatentAttention) for a in attn)
    assert attn[0].kv_cache_spec(4) == LatentAttentionSpec(1, 48, 4)  # one row per token


def test_mtp_tensors_are_skipped_and_unknown_ones_rejected(tiny, tmp_path):
    path, _ = tiny
    weights = load_file(str(path / "model.safetensors"))
    cfg = load_model(str(path)).hf_config
    n = cfg.num_hidden_layers
    extra = {f"model.layers.{n}.enorm.weight": torch.ones(64),
             f"model.layers.{n}.eh_proj.weight": torch.zeros(64, 128)}
    model = DeepseekV2ForCausalLM(cfg, torch.float32)
    loaded = model.load_weights(list(weights.items()) + list(extra.items()))
    assert loaded == {name for name, _ in model.named_parameters()}
    with pytest.raises(ValueError, match="no matching parameter"):
        model.load_weights([("model.layers.0.self_attn.bogus.weight", torch.zeros(1))])


@pytest.mark.parametrize("name,total,active,layers", [
    ("deepseek-ai/DeepSeek-V2-Lite", 15.7, 2.66, 27),
    ("moonshotai/Kimi-K2-2layers", 19.9, 3.35, 2),
])
def test_shipped_shapes(name: str, total: float, active: float, layers: int):
    """DeepSeek's model card: V2-Lite has 15.7B parameters, 2.4B active without the
    embedding and output matrices (0.42B together)."""
    cfg = load_model(name, load_format="dummy").hf_config
    cls = resolve_model_class(cfg)
    with torch.device("meta"):
        model = cls(cfg, torch.bfloat16)
    n_all = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    assert n_all / 1e9 == pytest.approx(total, abs=0.05)
    assert (n_all - experts * (e - k) // e) / 1e9 == pytest.approx(active, abs=0.05)
    per_block = sum(s.page_bytes(16) for s in layer_specs(model.attention_layers(),
                                                          torch.bfloat16))
    assert per_block == layers * 576 * 2 * 16  # one 576-value latent row per token per layer


def _logits_and_heads(path: str) -> tuple[torch.Tensor, int]:
    model = load_tp_model(path)
    return prompt_logits(model), model.attention_layers()[0].num_heads


def test_two_rank_split_matches_one_rank(tiny):
    path, _ = tiny
    expected, heads = _logits_and_heads(str(path))
    got, rank_heads = run_on_two_ranks(_logits_and_heads, str(path))
    assert rank_heads * 2 == heads
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)



def test_fault_zeroing_clears_only_the_named_latent_blocks(tiny):
    """After non-finite logits the runner zeroes the request's blocks: on a one-plane latent
    cache exactly those blocks (a K/V-plane view would also hit a block half the pool away)."""
    path, _ = tiny
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks_override=8,
              max_model_len=32)
    runner = llm.llm_engine.core.runner
    for kv in runner.kv_caches:
        kv.fill_(1.0)
    runner._zero_slots([(1, 0), (3, 2)])
    for kv in runner.kv_caches:
        blocks = kv.view(kv.shape[0], -1, 4, *kv.shape[2:])
        zero = [b for b in range(blocks.shape[1]) if not blocks[:, b].any()]
        assert zero == [1]
        assert not blocks[:, 3, 2:].any() and blocks[:, 3, :2].all()


def test_pooling_runner_refuses_latent_attention(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="latent attention"):
        LLM(model=str(path), dtype="float32", runner="pooling")


def test_heads_must_split_evenly_over_tensor_parallel_ranks(monkeypatch):
    import shoal.models.deepseek_v2 as ds

    monkeypatch.setattr(ds, "get_tp_world_size", lambda: 3)
    cfg = AutoConfig.for_model("deepseek_v3", **V3)
    with pytest.raises(ValueError, match="num_attention_heads .4. is not divisible by "
                                         "tensor_parallel_size .3."):
        ds.DeepseekMLA(cfg, torch.float32)

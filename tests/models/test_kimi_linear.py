"""Kimi Linear against transformers on a tiny random checkpoint (3 KDA layers, 1 NoPE latent
attention layer, a dense first MLP then grouped sigmoid-routed experts with a shared one),
through the whole engine in mixed chunked batches; plus the dummy loader, the layer layout
and the block size that lets a latent page hold a KDA state."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from oracle import draft_continuations, hf_greedy, randomize_weights, record_replay_widths
from transformers import AutoConfig, AutoModelForCausalLM

from shoal import LLM, SamplingParams
from shoal.layers.kimi_delta_attention import KimiDeltaAttention
from shoal.layers.latent_attention import LatentAttention
from shoal.loader import load_model
from shoal.models.deepseek_v2 import DeepseekMLP, DeepseekMoE
from shoal.models.kimi_linear import KimiLinearForCausalLM
from shoal.models.registry import resolve_model_class

KIMI = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32,
    num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
    routed_scaling_factor=2.5, first_k_dense_replace=1, rms_norm_eps=1e-5,
    linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 16,
                        "num_heads": 2, "short_conv_kernel_size": 4},
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)


def write_kimi_checkpoint(path: Path, seed: int) -> Path:
    """As oracle.write_tiny_checkpoint, with the decays kept in a sensible range: A_log
    near 0 (rate ~1 per head) and dt_bias about -3 (softplus ~0.05), so KDA remembers
    tens of tokens rather than forgetting each at once."""
    cfg = AutoConfig.for_model("kimi_linear", **KIMI)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_kimi_checkpoint(tmp_path_factory.mktemp("kimi-linear"), seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _check(llm: LLM, hf, prompts: list[list[int]], n: int = 10) -> float:
    """Greedy tokens equal transformers'; returns the largest logprob error."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    worst = 0.0
    for p, o in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, p, n)
        got = o.outputs[0]
        assert got.token_ids == ref, len(p)
        for step, (tok, lg) in enumerate(zip(got.token_ids, ref_logits)):
            want = torch.log_softmax(lg, -1)[tok].item()
            worst = max(worst, abs(got.logprobs[step][tok].logprob - want))
    return worst


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def test_greedy_matches_transformers_in_mixed_chunked_batches(tiny):
    path, hf = tiny
    # 48 tokens a step: prompts up to 150 tokens run as chunks beside other requests' decodes;
    # blocks are raised to 64 tokens (a page holds a KDA state).
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=48,
              num_gpu_blocks_override=64, max_model_len=512)
    prompts = _prompts((1, 7, 63, 64, 65, 150), seed=2)
    worst = _check(llm, hf, prompts)
    # Prefix hits: the states saved at the block ends (64, 128) of the 150-token prompt.
    rest = _prompts((3, 40), seed=3)
    worst = max(worst, _check(llm, hf, [prompts[-1][:130] + rest[0], prompts[-1] + rest[1]]))
    print(f"max |logprob error| {worst:.2e}")
    assert worst < 1e-4, worst


def test_two_ranks_match_transformers(tiny):
    """Tensor parallel: KDA heads, latent-attention heads and experts split over two ranks."""
    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", tensor_parallel_size=2,
              max_num_batched_tokens=48, num_gpu_blocks_override=64, max_model_len=512)
    try:
        layers = llm.llm_engine.core.runner.driver.model.attention_layers()
        assert layers[0].state_heads == 1 and layers[3].num_heads == 2  # of 2 and 4
        assert _check(llm, hf, _prompts((5, 90), seed=4)) < 1e-4
    finally:
        llm.shutdown()


def test_dummy_weights_generate(tiny):
    path, _ = tiny
    llm = LLM(model=str(path), load_format="dummy", dtype="float32",
              num_gpu_blocks_override=64, max_model_len=128)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_layers_and_checkpoint_names(tiny):
    """transformers' layer kinds; the saved (original) names and transformers' in-memory
    names (forget_gate.*, one conv1d, stacked experts) fill every parameter alike."""
    path, hf = tiny
    cfg = load_model(str(path)).hf_config
    assert resolve_model_class(cfg) is KimiLinearForCausalLM
    a, b = KimiLinearForCausalLM(cfg, torch.float32), KimiLinearForCausalLM(cfg, torch.float32)
    kinds = [KimiDeltaAttention] * 3 + [LatentAttention]
    assert all(isinstance(x, k) for x, k in zip(a.attention_layers(), kinds, strict=True))
    assert isinstance(a.model.layers[0].mlp, DeepseekMLP)
    assert all(isinstance(layer.mlp, DeepseekMoE) for layer in a.model.layers[1:])
    everything = {n for n, _ in a.named_parameters()}
    assert a.load_weights(load_model(str(path)).weights()) == everything
    assert b.load_weights(hf.state_dict().items()) == everything
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n


def test_block_size_holds_a_state():
    """Kimi-Linear-48B's shapes: a KDA state (32 heads of 128 x 128, conv of 3 x 4096 x 3
    float32 words) in bf16 latent rows of 576 values."""
    cfg = AutoConfig.for_model("kimi_linear", kv_lora_rank=512, qk_rope_head_dim=64,
                               linear_attn_config={"head_dim": 128, "num_heads": 32,
                                                   "short_conv_kernel_size": 4})
    size = KimiLinearForCausalLM.block_size_for(cfg, 2, 1)
    state = 4 * (32 * 128 * 128 + 3 * 4096 * 3)
    assert size % 64 == 0 and (size - 64) * 576 * 2 < state <= size * 576 * 2
    assert KimiLinearForCausalLM.block_size_for(cfg, 2, 2) < size


def test_speculative_decoding_replays_the_accepted_run(tiny, monkeypatch):
    """KDA's per-channel decay through the verify-and-replay path: ngram's verify steps with
    drafts that are transformers' continuation, one in two with a wrong token; lossless."""
    path, hf = tiny
    prompts = _prompts((30, 90), seed=6)
    refs = {tuple(p): hf_greedy(hf, p, 24)[0] for p in prompts}
    draft_continuations(monkeypatch, refs)
    widths = record_replay_widths(monkeypatch)
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=64,
              num_gpu_blocks_override=64, max_model_len=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "adaptive_budget": False})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    assert widths and all(kept == width for kept, width in widths)
    runner = llm.llm_engine.core.runner
    layers = [a for a in runner.model.attention_layers() if hasattr(a, "replay_width")]
    # max_num_seqs requests x (3 drafts + 1) tokens, float32
    seqs = runner.config.scheduler_config.max_num_seqs
    assert runner.replay_reserve_bytes() == seqs * 4 * sum(a.replay_width for a in layers) * 4


def test_preemption_recomputes_the_state(tiny):
    """12 blocks of 64 tokens: four requests of up to 150 tokens cannot all hold their KV
    tables and KDA states at once."""
    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=48,
              num_gpu_blocks_override=12, max_model_len=512, enable_prefix_caching=False)
    assert _check(llm, hf, _prompts((150, 120, 90, 140), seed=9), n=16) < 1e-4
    assert llm.llm_engine.core.scheduler.num_preemptions > 0

"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet beside gated attention) against
transformers on tiny random checkpoints, through the whole engine: mixed chunked batches,
prefix-cache hits that restore a linear layer's state, preemption, two tensor-parallel
ranks; plus the dummy loader and the block size that lets a page hold a state."""

from __future__ import annotations

import random

import pytest
import torch
from oracle import (
    TINY_COMMON,
    draft_continuations,
    hf_greedy,
    randomize_weights,
    record_replay_widths,
    write_tiny_checkpoint,
)
from transformers import AutoConfig, AutoModelForCausalLM

from shoal import LLM, SamplingParams
from shoal.engine.scheduler import Scheduler
from shoal.models.qwen3_next import hybrid_block_size

LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
KINDS = {
    "qwen3_next": {**LINEAR, **MOE, "mlp_only_layers": [1], "norm_topk_prob": True},
    "qwen3_5_text": LINEAR,
    "qwen3_5_moe_text": {**LINEAR, **MOE},
}
STEPS = 12


@pytest.fixture(scope="module", params=sorted(KINDS))
def tiny(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=1,
                                 **KINDS[request.param])
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(n: int, seed: int, longest: int = 150) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, longest))] for _ in range(n)]


def _check(llm: LLM, hf, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, p, STEPS)
        got = o.outputs[0]
        assert got.token_ids == ref
        for step, (tok, lg) in enumerate(zip(got.token_ids, ref_logits)):
            want = torch.log_softmax(lg, -1)[tok].item()
            assert got.logprobs[step][tok].logprob == pytest.approx(want, abs=1e-4)
    return outs


def test_greedy_matches_transformers_in_mixed_chunked_batches(tiny):
    path, hf = tiny
    # 48 tokens a step: prompts of up to 150 run in chunks beside other requests' decodes
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=48,
              num_gpu_blocks_override=64, max_model_len=512)
    assert llm.llm_engine.config.cache_config.block_size == 64  # raised to hold a state
    _check(llm, hf, _prompts(6, seed=2))
    stats = llm.llm_engine.core.scheduler.stats()
    # 3 linear layers: conv (2 x 32 + 64 channels x 3) and delta rule (4 x 16 x 16) float32
    assert stats.state_bytes_per_request == 3 * 4 * (128 * 3 + 4 * 16 * 16)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_hits_restore_the_linear_state(tiny, async_scheduling: bool):
    """(With async scheduling a step is scheduled while the one before runs: state blocks are
    published a step late, so a hit never reads a state still being written.)"""
    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=48,
              num_gpu_blocks_override=64, max_model_len=512,
              async_scheduling=async_scheduling)
    rng = random.Random(3)
    base = [rng.randrange(3, 512) for _ in range(200)]
    _check(llm, hf, [base])
    # hits of one and two blocks, then chunks or a lone decode after the restored state
    prompts = [base[:150] + [rng.randrange(3, 512) for _ in range(k)] for k in (5, 40)]
    prompts += [base[:129], base[:100]]
    outs = _check(llm, hf, prompts)
    assert [o.num_cached_tokens for o in outs] == [128, 128, 128, 64]


def test_preemption_recomputes_the_state(tiny):
    path, hf = tiny
    # 16 blocks of 64: six requests cannot all hold their tables and states at once
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=48,
              num_gpu_blocks_override=16, max_model_len=512, enable_prefix_caching=False)
    _check(llm, hf, _prompts(6, seed=4, longest=200))
    assert llm.llm_engine.core.scheduler.num_preemptions > 0


def test_two_ranks_match_transformers(tiny):
    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", tensor_parallel_size=2,
              max_num_batched_tokens=48, num_gpu_blocks_override=64, max_model_len=512)
    _check(llm, hf, _prompts(3, seed=5))


def test_dummy_weights_generate(tiny):
    path, _ = tiny
    llm = LLM(model=str(path), load_format="dummy", dtype="float32",
              num_gpu_blocks_override=64, max_model_len=256)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_block_size_of_the_real_shapes():
    """Qwen3-Next-80B-A3B: 16 key / 32 value heads of 128, kernel 4, 2 KV heads of 256: a
    layer's state is 2.06 MiB of float32, a bf16 token of attention 2 KiB per plane pair."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(linear_num_key_heads=16, linear_num_value_heads=32,
                          linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_conv_kernel_dim=4, num_key_value_heads=2, head_dim=256)
    assert hybrid_block_size(cfg, 2, 1) == 1088
    assert hybrid_block_size(cfg, 2, 2) == 1088  # state and KV heads both halve
    assert hybrid_block_size(cfg, 2, 4) == 576  # KV heads replicate past 2 ranks


def test_speculative_decoding_replays_the_accepted_run(tiny, monkeypatch):
    """ngram's verify path with drafts that are transformers' own continuation, one in two
    steps with a wrong token: the linear layers fold in only the accepted run (ReplaySSM),
    and the tokens stay transformers' (lossless)."""
    path, hf = tiny
    prompts = _prompts(4, seed=6)
    refs = {tuple(p): hf_greedy(hf, p, 3 * STEPS)[0] for p in prompts}
    draft_continuations(monkeypatch, refs)
    widths = record_replay_widths(monkeypatch)
    verified: list[tuple[int, int]] = []  # (drafts, accepted) of each verify
    settle = Scheduler._settle_verified

    def count(self, req, num_drafts: int, accepted: int) -> None:
        verified.append((num_drafts, accepted))
        settle(self, req, num_drafts, accepted)

    monkeypatch.setattr(Scheduler, "_settle_verified", count)
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=64,
              num_gpu_blocks_override=64, max_model_len=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "adaptive_budget": False})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=3 * STEPS, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    drafts, accepted = map(sum, zip(*verified))
    assert 0 < accepted < drafts
    assert widths and all(kept == width for kept, width in widths)
    runner = llm.llm_engine.core.runner
    layers = [a for a in runner.model.attention_layers() if hasattr(a, "replay_width")]
    # max_num_seqs requests x (3 drafts + 1) tokens, float32
    seqs = runner.config.scheduler_config.max_num_seqs
    assert runner.replay_reserve_bytes() == seqs * 4 * sum(a.replay_width for a in layers) * 4


def _with_mtp_layer(path, model_type: str, fields: dict) -> None:
    """Adds an MTP layer (mtp.*, as Qwen's checkpoints store it) to a tiny checkpoint: a
    full-attention decoder layer drawn by transformers, fc and three offset norms."""
    import json

    from safetensors.torch import load_file, save_file

    one = {**fields, "num_hidden_layers": 1, "layer_types": ["full_attention"],
           "mlp_only_layers": []}
    mtp = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{
        **TINY_COMMON, **one}), dtype=torch.float32)
    torch.manual_seed(7)
    tensors = load_file(path / "model.safetensors")
    h = TINY_COMMON["hidden_size"]
    for name, t in mtp.state_dict().items():
        if name.startswith("model.layers.0."):
            tensors["mtp.layers.0." + name[len("model.layers.0."):]] = (
                torch.randn_like(t) * 0.2 if t.dim() > 1 else torch.rand_like(t) + 0.5)
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h) * 0.2
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        tensors[f"mtp.{norm}.weight"] = torch.rand(h) * 0.5
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))


def test_mtp_layer_drafts_losslessly(tmp_path):
    """method="mtp" with the checkpoint's own MTP layer (random weights: its drafts are
    mostly rejected): every mtp.* tensor loads, and the tokens stay transformers'."""
    path = write_tiny_checkpoint(tmp_path / "next", "qwen3_next", seed=1, **KINDS["qwen3_next"])
    _with_mtp_layer(path, "qwen3_next", KINDS["qwen3_next"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=64,
              num_gpu_blocks_override=64, max_model_len=512,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                  "adaptive_budget": False})
    prompts = _prompts(3, seed=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, STEPS)[0]
                                                      for p in prompts]
    head = llm.llm_engine.core.runner.drafter.model
    assert type(head).__name__ == "Qwen3NextMTP"
    assert head.layers[0].mlp.experts.w13_weight.abs().sum() > 0  # the experts loaded


@pytest.mark.timeout(120)
def test_an_admitted_prompt_runs_in_the_fewest_blocks_admission_counts(tmp_path):
    """14 blocks of 64: a 256-token prompt in chunks of 128 needs 5 KV blocks and, per state
    group (3), the block it reads and the 2 its chunk reaches. Blocks a step no longer reads
    leave before it allocates, so the request runs (it preempted itself forever when the old
    chunk's blocks were still held)."""
    path = write_tiny_checkpoint(tmp_path / "q35", "qwen3_5_text", seed=1,
                                 **KINDS["qwen3_5_text"])
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=128,
              num_gpu_blocks_override=14, max_model_len=512)
    out = llm.generate({"prompt_token_ids": _prompts(1, seed=10, longest=2)[0] * 256},
                       SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1
    assert llm.llm_engine.core.scheduler.num_preemptions == 0


def test_a_finished_requests_last_states_are_cached(tiny):
    """A prompt run in one step (max_tokens 1): the states its step wrote are published when
    it ends, so the same prompt plus a few tokens hits all its full blocks."""
    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=256,
              num_gpu_blocks_override=64, max_model_len=512)
    prompt = _prompts(1, seed=11, longest=2)[0] * 200
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    outs = _check(llm, hf, [prompt + [5, 6, 7]])
    assert outs[0].num_cached_tokens == 192


def test_a_qwen3_5_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Qwen/Qwen3.5-* repos are Qwen3_5ForConditionalGeneration: language-model-only (every
    modality's limit 0; with images it is tests/multimodal/test_qwen3_5_vl.py's class) loads
    the text model from model.language_model.* (the vision tower is skipped) and gives the
    tokens transformers' multimodal class gives for text alone."""
    from transformers import AutoModelForImageTextToText, Qwen3_5Config

    text = {**TINY_COMMON, **KINDS["qwen3_5_text"]}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=TINY_COMMON["hidden_size"], patch_size=16)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False),
        dtype=torch.float32)
    randomize_weights(model)
    model.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_gpu_blocks_override=32,
              max_model_len=256, limit_mm_per_prompt={"image": 0, "video": 0})
    assert type(llm.llm_engine.core.runner.model).__name__ == "Qwen3_5ForCausalLM"
    _check(llm, model.eval(), _prompts(3, seed=12))


def test_a_dense_draft_model_drafts_for_a_hybrid_losslessly(tiny, tiny_llama_dir):
    """method="draft_model" with a Llama draft: its KV follows the target's full-attention
    block table, the target's linear layers replay the accepted runs; tokens stay
    transformers'. A draft with linear-attention layers is refused by name."""
    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=64,
              num_gpu_blocks_override=64, max_model_len=256,
              speculative_config={"method": "draft_model", "model": str(tiny_llama_dir),
                                  "num_speculative_tokens": 2, "adaptive_budget": False})
    _check(llm, hf, _prompts(3, seed=13))
    with pytest.raises(ValueError, match="draft model with linear-attention layers"):
        LLM(model=str(path), dtype="float32", num_gpu_blocks_override=64, max_model_len=256,
            speculative_config={"method": "draft_model", "model": str(path),
                                "num_speculative_tokens": 2})

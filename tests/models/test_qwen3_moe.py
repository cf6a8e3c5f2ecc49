"""Qwen3-MoE against transformers on a tiny random checkpoint (8 experts, top-2, one dense
layer through mlp_only_layers), through the whole engine; plus the layer layout rules, both
checkpoint layouts of the experts, the dummy loader, the shipped 30B-A3B config and a
two-rank tensor-parallel split."""

from __future__ import annotations

import random

import pytest
import torch
from gloo_harness import load_tp_model, prompt_logits, run_on_two_ranks
from oracle import hf_greedy, write_tiny_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from shoal import LLM, SamplingParams
from shoal.layers.moe.layer import FusedMoE
from shoal.loader import load_model
from shoal.models.llama import LlamaMLP
from shoal.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseBlock
from shoal.models.registry import resolve_model_class

MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           mlp_only_layers=[1], norm_topk_prob=True, head_dim=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3-moe"), "qwen3_moe", seed=1, **MOE)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def test_greedy_matches_transformers_in_mixed_chunked_batches(tiny):
    path, hf = tiny
    # A small token budget forces chunked prefill and decodes mixed with prefill chunks.
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=24, block_size=4,
              num_gpu_blocks_override=256, max_model_len=256)
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, p, 12)
        got = o.outputs[0]
        assert got.token_ids == ref
        for step, (tok, lg) in enumerate(zip(got.token_ids, ref_logits)):
            want = torch.log_softmax(lg, -1)[tok].item()
            assert got.logprobs[step][tok].logprob == pytest.approx(want, abs=1e-4)
            assert got.logprobs[step][tok].rank == 1


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


def test_dummy_weights_generate(tiny):
    path, _ = tiny
    llm = LLM(model=str(path), load_format="dummy", dtype="float32", block_size=4,
              num_gpu_blocks_override=64, max_model_len=128)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("step,only", [(1, [1]), (2, []), (2, [3]), (1, [])])
def test_sparse_layers_follow_transformers(step: int, only: list[int]):
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, vocab_size=64, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=16, decoder_sparse_step=step,
                               mlp_only_layers=only)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
        ours = Qwen3MoeForCausalLM(cfg, torch.float32)
    for h, s in zip(hf.model.layers, ours.model.layers):
        sparse = isinstance(h.mlp, Qwen3MoeSparseMoeBlock)
        assert isinstance(s.mlp, Qwen3MoeSparseBlock if sparse else LlamaMLP)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_sparse_block_matches_transformers(norm_topk_prob: bool):
    """One MoE block on its own, with and without renormalised top-k weights."""
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=48, num_experts=6, num_experts_per_tok=3,
                               moe_intermediate_size=24, norm_topk_prob=norm_topk_prob,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, vocab_size=64, intermediate_size=64)
    torch.manual_seed(0)
    hf = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    ours = Qwen3MoeForCausalLM(cfg, torch.float32)
    loaded = ours.load_weights((f"model.layers.0.mlp.{k}", v) for k, v in hf.state_dict().items())
    assert loaded == {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.w13_weight",
                      "model.layers.0.mlp.experts.w2_weight"}
    x = torch.randn(7, 48)
    with torch.no_grad():
        want = hf(x[None])
        want = want[0] if isinstance(want, tuple) else want  # transformers 4 adds router logits
        torch.testing.assert_close(ours.model.layers[0].mlp(x), want[0], atol=1e-5, rtol=1e-5)


def test_stacked_and_per_expert_checkpoints_load_alike(tiny):
    """safetensors hold one tensor per expert; transformers 5's state_dict stacks them."""
    path, hf = tiny
    cfg = load_model(str(path)).hf_config
    a, b = Qwen3MoeForCausalLM(cfg, torch.float32), Qwen3MoeForCausalLM(cfg, torch.float32)
    names_a = a.load_weights(load_model(str(path)).weights())
    names_b = b.load_weights(hf.state_dict().items())
    assert names_a == names_b == {n for n, _ in a.named_parameters()}
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    experts = a.model.layers[0].mlp.experts
    assert isinstance(experts, FusedMoE) and experts.w13_weight.shape == (8, 64, 64)
    assert isinstance(a.model.layers[1].mlp, LlamaMLP)


def test_shipped_qwen3_30b_a3b_config():
    loaded = load_model("Qwen/Qwen3-30B-A3B", load_format="dummy")
    cfg = loaded.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.norm_topk_prob) == (48, 2048, 128, 8, 768, True)
    cls = resolve_model_class(cfg)
    assert cls is Qwen3MoeForCausalLM
    with torch.device("meta"):
        model = cls(cfg, torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts * (128 - 8) // 128
    # Qwen's model card: 30.5B in all, 3.3B activated per token.
    assert total / 1e9 == pytest.approx(30.5, abs=0.05)
    assert active / 1e9 == pytest.approx(3.3, abs=0.1)


# ---- tensor parallel ---------------------------------------------------------------------


def _logits_and_expert_rows(path: str) -> tuple[torch.Tensor, int]:
    """The prompt's logits on whatever TP group is initialised, and the rows of this rank's
    stacked gate/up weight of one expert (to show the experts were split)."""
    model = load_tp_model(path)
    return prompt_logits(model), model.model.layers[0].mlp.experts.w13_weight.shape[1]


def test_two_rank_split_matches_one_rank(tiny):
    path, _ = tiny
    expected, full_rows = _logits_and_expert_rows(str(path))
    got, rows = run_on_two_ranks(_logits_and_expert_rows, str(path))
    assert rows * 2 == full_rows  # each rank holds half of every expert
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

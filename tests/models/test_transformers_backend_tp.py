"""Tensor parallelism through the Transformers backend (transformers_backend/tensor_parallel.py):
the engine on two CPU ranks (gloo) gives transformers' own greedy tokens and logprobs, on
Llama (which shoal also runs natively, forced through the backend; its one KV head kept whole
on both ranks) and on Gemma (no class of shoal's own); a config without a tensor-parallel
plan, or whose heads do not divide by the rank count, is refused naming the field."""

from __future__ import annotations

import pytest
import torch
from oracle import TINY_COMMON, check_against_hf, greedy_with_logprobs, write_tiny_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from shoal import LLM
from shoal.engine.engine_args import EngineArgs
from shoal.layers.linear import ColumnParallelLinear, RowParallelLinear
from shoal.models.transformers_backend.tensor_parallel import ReplicatedKVLinear, tp_plan


def _config(model_type: str, **fields):
    return AutoConfig.for_model(model_type, **{**TINY_COMMON, **fields})


@pytest.mark.parametrize("model_type, fields", [
    # shoal's own LlamaForCausalLM is bypassed (model_impl="transformers"); one KV head for
    # two ranks: each keeps it whole (k_proj / v_proj replicated)
    ("llama", dict(num_key_value_heads=1)),
    ("gemma", dict(head_dim=16)),  # no class of shoal's own; its 2 KV heads split
])
def test_two_ranks_match_transformers(model_type, fields, tmp_path) -> None:
    """Chunked prefills beside decodes on two ranks: transformers' tokens and logprobs, rank
    0 holding half of each split layer and half of the query heads."""
    path = write_tiny_checkpoint(tmp_path, model_type, seed=1, **fields)
    llm = LLM(model=str(path), model_impl="transformers", dtype="float32",
              tensor_parallel_size=2, max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=64, max_model_len=64)
    try:
        model = llm.llm_engine.core.runner.driver.model  # rank 0, in this process
        layer = model.model.layers[0]
        assert type(model).__name__ == "TransformersForCausalLM"
        assert isinstance(layer.self_attn.k_proj, ColumnParallelLinear)
        assert isinstance(layer.mlp.down_proj, RowParallelLinear)
        # 4 heads of 16 (2 KV heads), MLP of 128: halves on this rank
        assert layer.self_attn.q_proj.weight.shape == (32, 64)
        assert layer.mlp.down_proj.weight.shape == (64, 64)
        assert [(a.num_heads, a.num_kv_heads) for a in model.attention_layers()] == [(2, 1)] * 2
        replicated = fields.get("num_key_value_heads") == 1
        assert isinstance(layer.self_attn.k_proj, ReplicatedKVLinear) == replicated
        assert layer.self_attn.k_proj.weight.shape == (16, 64)  # one KV head of 16
        prompts = [[(7 * i) % 500 + 3 for i in range(23)], [7, 9, 11], list(range(40, 47))]
        outs = greedy_with_logprobs(llm, prompts, 4)
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_against_hf(outs, prompts, hf, 4)


def test_the_engine_config_refuses_before_any_rank_starts() -> None:
    """create_engine_config raises the model's own ValueError, word for word, so no rank is
    ever started for a model whose plan cannot split it; a plan that can passes."""
    args = EngineArgs(device="cpu", model_impl="transformers", tensor_parallel_size=2,
                      max_model_len=64)
    gpt2 = _config("gpt2")
    gpt2.architectures = ["GPT2LMHeadModel"]
    odd = _config("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    odd.architectures = ["LlamaForCausalLM"]
    for cfg in (gpt2, odd):
        with pytest.raises(ValueError) as refused:
            args.create_engine_config(cfg)
        with pytest.raises(ValueError) as built:
            tp_plan(cfg, 2)
        assert str(refused.value) == str(built.value)
    llama = _config("llama")
    llama.architectures = ["LlamaForCausalLM"]
    assert args.create_engine_config(llama).parallel_config.tensor_parallel_size == 2


def test_the_model_refuses_what_its_plan_cannot_split(monkeypatch) -> None:
    """Built on two ranks (the world size as the layers see it), the backend refuses before
    building anything; on one rank the same configs build."""
    from shoal.models.transformers_backend import model as backend

    gpt2 = _config("gpt2")
    gpt2.architectures = ["GPT2LMHeadModel"]
    odd = _config("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    for cfg in (gpt2, odd):
        backend.TransformersForCausalLM(cfg, torch.float32)
    monkeypatch.setattr(backend, "get_tp_world_size", lambda: 2)
    with pytest.raises(ValueError, match="GPT2LMHeadModel with tensor_parallel_size 2: its "
                                         "config has no base_model_tp_plan"):
        backend.TransformersForCausalLM(gpt2, torch.float32)
    with pytest.raises(ValueError, match=r"its num_attention_heads \(3\) is not divisible by "
                                         r"tensor_parallel_size \(2\)"):
        backend.TransformersForCausalLM(odd, torch.float32)


@pytest.mark.parametrize("model_type, fields, tp, message", [
    ("gpt2", {}, 2, "GPT2LMHeadModel with tensor_parallel_size 2: its config has no "
                    "base_model_tp_plan"),
    ("llama", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3), 2,
     r"its num_key_value_heads \(3\) is not divisible by tensor_parallel_size \(2\)"),
    ("llama", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=6), 4,
     r"its num_attention_heads \(6\) is not divisible by tensor_parallel_size \(4\)"),
    ("llama", dict(base_model_tp_plan={"layers.*.mlp.up_proj": "colwise",
                                       "layers.*.mlp.down_proj": "packed_rowwise"}), 2,
     "puts 'layers.*.mlp.down_proj' in style 'packed_rowwise', which shoal does not apply"),
])
def test_plans_the_backend_cannot_apply_are_refused(model_type, fields, tp, message) -> None:
    cfg = _config(model_type, **fields)
    cfg.architectures = {"gpt2": ["GPT2LMHeadModel"]}.get(model_type, ["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=message):
        tp_plan(cfg, tp)


def test_plan_styles() -> None:
    """Which heads a plan splits: q/k/v gathered back whole (OLMo 2) keep all heads local."""
    assert tp_plan(_config("llama"), 2).splits_heads
    olmo2 = tp_plan(AutoConfig.for_model("olmo2", **TINY_COMMON), 2)
    assert not olmo2.splits_heads
    assert olmo2.style_of("layers.11.self_attn.o_proj") == "rowwise_split_input"
    assert olmo2.style_of("layers.1.self_attn.o_proj.x") is None

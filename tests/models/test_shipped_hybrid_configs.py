"""The shipped hybrid linear-attention shapes (shoal/model_configs/, for load_format="dummy"):
each resolves by name to shoal's class, has the real checkpoint's shapes and layer pattern,
and builds on the meta device to the parameter counts of its model card."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from shoal.layers.moe.layer import FusedMoE
from shoal.loader import load_model
from shoal.loader.resolve import resolve_model
from shoal.models.kimi_linear import KimiLinearForCausalLM
from shoal.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from shoal.models.qwen3_next import Qwen3NextForCausalLM
from shoal.models.registry import resolve_model_class

QWEN3_NEXT_24 = "Qwen/Qwen3-Next-80B-A3B-Instruct-24layers"
QWEN3_NEXT_16 = "Qwen/Qwen3-Next-80B-A3B-Instruct-16layers"
QWEN35_27B = "Qwen/Qwen3.5-27B"
QWEN35_35B = "Qwen/Qwen3.5-35B-A3B"
KIMI_LINEAR = "moonshotai/Kimi-Linear-48B-A3B-Instruct"
KIMI_LINEAR_16 = "moonshotai/Kimi-Linear-48B-A3B-Instruct-16layers"


def _every_fourth(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def _counts(cfg, cls) -> tuple[float, float]:
    """(total, active) parameters in billions of the model built on the meta device; active:
    the routed experts' stacked weights replaced by num_experts_per_tok experts per layer."""
    with torch.device("meta"):
        model = cls(cfg, torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    routed = active = 0
    for mod in model.modules():
        if isinstance(mod, FusedMoE):
            n = mod.w13_weight.numel() + mod.w2_weight.numel()
            routed += n
            active += cfg.num_experts_per_tok * n // mod.num_experts
    return total / 1e9, (total - routed + active) / 1e9


def _load(name: str):
    cfg = load_model(name, load_format="dummy").hf_config
    return cfg, resolve_model_class(cfg)


def test_qwen3_next_24_layers():
    cfg, cls = _load(QWEN3_NEXT_24)
    assert cls is Qwen3NextForCausalLM
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (
        24, 2048, 512, 10, 512, 512)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (16, 2, 256)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (16, 32, 128, 128, 4)
    assert cfg.layer_types == _every_fourth(24)
    assert cls.block_size_for(cfg, 2, 1) == 1088
    total, active = _counts(cfg, cls)
    # Half the layers of an 80B model whose embedding and head (0.62B) stay whole.
    assert total == pytest.approx(40.15, abs=0.05)
    assert active == pytest.approx(2.25, abs=0.05)


def test_qwen3_next_full_depth_is_the_80b_model():
    """The same config at its real 48 layers: Qwen's model card, 80B in all and 3B activated
    (3.9B with the embedding and head tables counted whole, as here)."""
    raw = json.loads((resolve_model(QWEN3_NEXT_24).path / "config.json").read_text())
    raw |= {"num_hidden_layers": 48, "layer_types": _every_fourth(48)}
    raw.pop("architectures")
    cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
    total, active = _counts(cfg, Qwen3NextForCausalLM)
    assert total == pytest.approx(79.67, abs=0.05)
    assert active == pytest.approx(3.88, abs=0.05)
    half, _ = _counts(_load(QWEN3_NEXT_24)[0], Qwen3NextForCausalLM)
    assert half == pytest.approx(total / 2, rel=0.01)


def test_qwen3_next_16_layers_fits_an_80_gb_card():
    """Qwen3-Next's first 16 layers: the 24-layer config cut again, every layer the real
    shape, 54 GB of bf16 weights."""
    cfg, cls = _load(QWEN3_NEXT_16)
    cfg24, _ = _load(QWEN3_NEXT_24)
    assert cls is Qwen3NextForCausalLM
    assert cfg.num_hidden_layers == 16 and cfg.layer_types == _every_fourth(16)
    same = ("hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "linear_num_value_heads", "head_dim")
    assert all(getattr(cfg, f) == getattr(cfg24, f) for f in same)
    total, active = _counts(cfg, cls)
    total24, active24 = _counts(cfg24, cls)
    assert total == pytest.approx(0.62 + (total24 - 0.62) * 16 / 24, abs=0.05)
    assert active == pytest.approx(0.62 + (active24 - 0.62) * 16 / 24, abs=0.05)
    assert 2 * total < 60  # GB of bf16 weights, with room for the KV pool on 80 GB


def test_qwen35_27b():
    cfg, cls = _load(QWEN35_27B)
    assert cls is Qwen3_5ForCausalLM and cfg.model_type == "qwen3_5_text"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (
        64, 5120, 17408, 248320)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 4, 256)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (16, 48)
    assert cfg.layer_types == _every_fourth(64)
    total, active = _counts(cfg, cls)
    # 27B on the model card, with the vision encoder (~0.46B) this text decoder leaves out.
    assert total == pytest.approx(26.90, abs=0.05)
    assert active == total


def test_qwen35_35b_a3b():
    cfg, cls = _load(QWEN35_35B)
    assert cls is Qwen3_5MoeForCausalLM and cfg.model_type == "qwen3_5_moe_text"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (
        40, 2048, 256, 8, 512, 512)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (16, 2, 256)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (16, 32)
    assert cfg.layer_types == _every_fourth(40)
    total, active = _counts(cfg, cls)
    # Model card: 35B in all (vision encoder included), 3B activated.
    assert total == pytest.approx(34.66, abs=0.05)
    assert active == pytest.approx(3.46, abs=0.05)


def test_kimi_linear_48b_a3b():
    cfg, cls = _load(KIMI_LINEAR)
    assert cls is KimiLinearForCausalLM
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_local_experts,
            cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.kv_lora_rank) == (
        27, 2304, 256, 8, 1024, 512)
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim) == (32, 128, 4)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full == [3, 7, 11, 15, 19, 23, 26]  # 1-based 4, 8, ..., 24, 27 in the checkpoint
    assert cfg.mlp_layer_types == ["dense"] + ["sparse"] * 26
    total, active = _counts(cfg, cls)
    # Model card: 48B in all, 3B activated (Hugging Face lists the checkpoint at 49.1B).
    assert total == pytest.approx(49.12, abs=0.05)
    assert active == pytest.approx(3.48, abs=0.05)


def test_kimi_linear_16_layers_fits_an_80_gb_card():
    """Kimi-Linear's first 16 layers: the same pattern (a dense first layer, every fourth
    layer MLA), every layer the real shape, 57 GB of bf16 weights."""
    cfg, cls = _load(KIMI_LINEAR_16)
    full_cfg, _ = _load(KIMI_LINEAR)
    assert cls is KimiLinearForCausalLM
    assert cfg.num_hidden_layers == 16
    assert cfg.layer_types == full_cfg.layer_types[:16]
    assert cfg.mlp_layer_types == full_cfg.mlp_layer_types[:16]
    total, active = _counts(cfg, cls)
    full_total, full_active = _counts(full_cfg, cls)
    # 11 fewer layers of the same shape (every cut layer is KDA or MLA with a MoE MLP)
    per_layer = (full_total - total) / 11
    assert total == pytest.approx(28.70, abs=0.05)
    assert active == pytest.approx(2.37, abs=0.05)
    assert 2 * total < 60  # GB of bf16 weights, with room for the KV pool on 80 GB
    assert per_layer == pytest.approx((full_total - 0.75) / 27, rel=0.05)


@pytest.mark.parametrize("name", [QWEN3_NEXT_24, QWEN3_NEXT_16, QWEN35_27B, QWEN35_35B,
                                  KIMI_LINEAR, KIMI_LINEAR_16])
def test_names_resolve_case_insensitively(name):
    assert load_model(name.lower(), load_format="dummy").hf_config.architectures == \
        load_model(name, load_format="dummy").hf_config.architectures


def test_block_size_of_a_state_page():
    """A page of the real shapes holds a linear layer's state: Qwen3.5-27B's 48 value heads
    need fewer tokens of its 4 KV heads than Qwen3-Next's 32 need of 2."""
    for name, size in [(QWEN35_27B, 832), (QWEN35_35B, 1088), (KIMI_LINEAR, 1984)]:
        cfg, cls = _load(name)
        assert cls.block_size_for(cfg, 2, 1) == size, name

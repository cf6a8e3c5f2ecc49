"""Which modules get adapter slots (lora_target_modules, shoal/lora/target_modules.py): MoE
expert slots by default as vLLM (their bytes are counted, and the formula used for large
models is checked against the built tensors), none under a list without 'experts', an expert
adapter then refused naming the setting, the projections restricted by leaf or fused name
with the others' adapters refused by name, and unknown names refused at start-up. Slots are
built over shoal's models straight from a config (no weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle import TINY_COMMON
from peft_adapters import write_raw_adapter

from shoal.config.lora import LoRAConfig
from shoal.lora.adapter import check_adapter
from shoal.lora.expert_layers import expert_slot_bytes
from shoal.lora.request import LoRARequest
from shoal.lora.slots import LoRASlots
from shoal.models.registry import resolve_model_class

# Qwen3-MoE: layers 0 and 2 MoE (8 experts, intermediate 32), layer 1 a dense MLP
QWEN3_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
                 head_dim=16)
ATTN_SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32),
               "o_proj": (64, 64)}


def model(model_type: str, arch: str, **overrides) -> torch.nn.Module:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **{**TINY_COMMON, **overrides},
                               architectures=[arch])
    return resolve_model_class(cfg)(cfg, torch.float32, use_triton_ops=False)


def slots(m: torch.nn.Module, **config) -> LoRASlots:
    return LoRASlots(m, LoRAConfig(max_loras=2, max_lora_rank=8, **config), 32,
                     torch.float32, torch.device("cpu"))


def moe() -> torch.nn.Module:
    return model("qwen3_moe", "Qwen3MoeForCausalLM", **QWEN3_MOE)


def llama() -> torch.nn.Module:
    return model("llama", "LlamaForCausalLM")


def attention_adapter(path: Path, leaves: tuple[str, ...], layers=(0,)) -> Path:
    targets = {f"model.layers.{i}.self_attn.{leaf}": ATTN_SHAPES[leaf]
               for i in layers for leaf in leaves}
    return write_raw_adapter(path, targets, seed=5, r=4, leaves=leaves)


def expert_adapter(path: Path) -> Path:
    """Per-expert gate and down adapters of expert 3 of layer 0, and q_proj."""
    targets = {"model.layers.0.mlp.experts.3.gate_proj": (64, 32),
               "model.layers.0.mlp.experts.3.down_proj": (32, 64),
               "model.layers.0.self_attn.q_proj": (64, 64)}
    return write_raw_adapter(path, targets, seed=6, r=4,
                             leaves=("gate_proj", "down_proj", "q_proj"))


def slot_bytes(s: LoRASlots) -> int:
    return sum(t.numel() * t.element_size() for layer in s.expert_layers
               for t in (layer.a13, layer.b13, layer.a2, layer.b2))


def test_moe_experts_get_slots_unless_left_out(tmp_path, caplog):
    caplog.set_level("INFO", logger="shoal.lora.slots")
    default = slots(moe())  # unset: the experts too, as vLLM
    assert "adapter slots for the MoE experts of 2 layers" in caplog.text
    asked = slots(moe(), target_modules=("all-linear", "experts"))
    left_out = slots(moe(), target_modules=("all-linear",))
    assert left_out.expert_layers == [] and slot_bytes(left_out) == 0
    assert left_out.limits.left_out == ("experts",) and not left_out.limits.experts
    # two MoE layers x 8 experts x 2 slots x rank 8, fp32: 360448 bytes not allocated
    built = slot_bytes(default)
    assert len(default.expert_layers) == 2 and built == 360448 == slot_bytes(asked)
    assert built == expert_slot_bytes(2, 8, 64, 32, 2, 8, 4)
    assert left_out.limits.targets == default.limits.targets  # the projections are the same

    path = expert_adapter(tmp_path / "experts")
    with pytest.raises(ValueError, match="holds no adapter slots for them: start it with "
                                         "lora_target_modules unset or listing 'experts'"):
        check_adapter(str(path), left_out.limits)
    with pytest.raises(ValueError, match="lora_target_modules unset or listing 'experts'"):
        left_out.add(LoRARequest("e", 1, str(path)))  # the worker refuses it as well
    assert check_adapter(str(path), default.limits).modules
    assert default.add(LoRARequest("e", 1, str(path)))
    # an attention adapter is served either way
    assert left_out.add(LoRARequest("a", 2, str(attention_adapter(tmp_path / "a",
                                                                  ("q_proj",)))))


def test_target_modules_restrict_the_projections(tmp_path):
    default = slots(llama())
    q_only = slots(llama(), target_modules=("q_proj",))
    # the fused qkv layer takes adapters on all its parts (its slots are one tensor)
    assert sorted({n.rsplit(".", 1)[-1] for n in q_only.limits.targets}) == \
        ["k_proj", "q_proj", "v_proj"]
    assert q_only.limits.left_out == ("down_proj", "gate_proj", "o_proj", "up_proj")
    assert len(q_only.layers) == 2 < len(default.layers) == 8
    assert check_adapter(str(attention_adapter(tmp_path / "qv", ("q_proj", "v_proj"))),
                         q_only.limits)
    o_proj = attention_adapter(tmp_path / "o", ("q_proj", "o_proj"))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.o_proj, but "
                                         "lora_target_modules leaves 'o_proj' out"):
        check_adapter(str(o_proj), q_only.limits)
    assert check_adapter(str(o_proj), default.limits)
    # a fused layer's name stands for its parts; all-linear for every projection
    gate_up = slots(llama(), target_modules=("gate_up_proj",))
    assert sorted({n.rsplit(".", 1)[-1] for n in gate_up.limits.targets}) == \
        ["gate_proj", "up_proj"]
    assert slots(llama(), target_modules=("all-linear",)).limits == default.limits


@pytest.mark.parametrize("names, bad", [(("q_proj", "experts"), "'experts'"),
                                        (("qproj",), "'qproj'")])
def test_names_of_no_module_are_refused_at_start_up(names, bad):
    with pytest.raises(ValueError, match=f"lora_target_modules: {bad} name"):
        slots(llama(), target_modules=names)


@pytest.mark.parametrize("value", ["q_proj", [], ["model.layers.0.q_proj"], [3]])
def test_lora_config_checks_target_modules(value):
    with pytest.raises(ValueError, match="lora_target_modules"):
        LoRAConfig(target_modules=value)
    assert LoRAConfig(target_modules=["q_proj"]).target_modules == ("q_proj",)

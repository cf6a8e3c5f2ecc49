"""Every registered architecture follows shoal/models/interface.py: constructor arguments,
forward / compute_logits / attention_layers, load_weights filling every parameter from the
checkpoint's own names, and use_triton_ops reaching every layer that has a kernel."""

from __future__ import annotations

import inspect

import pytest
import torch
from oracle import TINY_COMMON
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from shoal.attention.metadata import build_attention_metadata
from shoal.layers.attention import Attention
from shoal.layers.latent_attention import LatentAttention
from shoal.loader.build import check_all_loaded
from shoal.models.interface import CausalLM
from shoal.models.registry import resolve_model_class, supported_architectures

# architecture -> (transformers model_type, config fields beyond the tiny common ones)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", {}),
    "MistralForCausalLM": ("mistral", {}),
    "Qwen2ForCausalLM": ("qwen2", {}),
    "Qwen3ForCausalLM": ("qwen3", {"head_dim": 16}),
    "Qwen3MoeForCausalLM": ("qwen3_moe", {"head_dim": 16, "num_experts": 4,
                                          "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 32}),
    "DeepseekV2ForCausalLM": ("deepseek_v2", {"kv_lora_rank": 32, "q_lora_rank": None,
                                              "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                                              "v_head_dim": 16, "n_routed_experts": 4,
                                              "num_experts_per_tok": 2, "n_shared_experts": 1,
                                              "moe_intermediate_size": 32,
                                              "first_k_dense_replace": 1}),
    "DeepseekV3ForCausalLM": ("deepseek_v3", {"kv_lora_rank": 32, "q_lora_rank": 24,
                                              "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                                              "v_head_dim": 16, "n_routed_experts": 4,
                                              "num_experts_per_tok": 2, "n_shared_experts": 1,
                                              "n_group": 2, "topk_group": 1,
                                              "moe_intermediate_size": 32,
                                              "first_k_dense_replace": 1}),
}


def test_every_registered_architecture_is_checked() -> None:
    assert sorted(ARCHITECTURES) == supported_architectures()


def _config(arch: str):
    model_type, extra = ARCHITECTURES[arch]
    return AutoConfig.for_model(model_type, **TINY_COMMON, **extra, architectures=[arch])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_signatures(arch: str) -> None:
    cls = resolve_model_class(_config(arch))
    assert cls.__name__ == arch and issubclass(cls, nn.Module)
    init = inspect.signature(cls.__init__).parameters
    assert list(init)[1:3] == ["hf_config", "dtype"]
    assert init["use_triton_ops"].kind is inspect.Parameter.KEYWORD_ONLY
    assert init["use_triton_ops"].default is True
    assert list(inspect.signature(cls.forward).parameters)[1:] == [
        "input_ids", "positions", "attn_metadata"]
    for src, (dst, shard) in cls.packed_modules_mapping.items():
        assert isinstance(src, str) and isinstance(dst, str) and isinstance(shard, str | int)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_model_follows_the_interface(arch: str) -> None:
    cfg = _config(arch)
    torch.manual_seed(0)
    model = resolve_model_class(cfg)(cfg, torch.float32, use_triton_ops=False)
    assert isinstance(model, CausalLM)
    flags = [m.use_triton_ops for m in model.modules() if hasattr(m, "use_triton_ops")]
    assert flags and not any(flags)

    # transformers' own parameter names, as a checkpoint stores them, fill every parameter.
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    check_all_loaded(model, model.load_weights(hf.state_dict().items()), arch)

    layers = model.attention_layers()
    assert len(layers) == cfg.num_hidden_layers
    assert all(isinstance(a, Attention | LatentAttention) for a in layers)
    n, bs = 5, 4
    for a in layers:
        a.kv_cache = torch.zeros(a.kv_planes, 3 * bs, a.num_kv_heads, a.head_dim)
    md = build_attention_metadata(query_lens=[n], context_lens=[0], block_tables=[[0, 1]],
                                  block_size=bs, num_decodes=0, sliding_window=None,
                                  device=torch.device("cpu"), null_block=2)
    with torch.inference_mode():
        hidden = model(torch.arange(3, 3 + n), torch.arange(n), md)
        logits = model.compute_logits(hidden)
    assert hidden.shape == (n, cfg.hidden_size)
    assert logits.shape == (n, cfg.vocab_size) and torch.isfinite(logits).all()

"""SmolLM3 (SmolLM3-3B): the Llama block where some layers have no positions at all (NoPE):
config.no_rope_layers holds 1 for a layer that applies the rotary and 0 for one that does not
(transformers fills it from no_rope_layer_interval: every interval-th layer is NoPE). A
sliding window, when use_sliding_window is set, applies to the layers config.layer_types
marks (layer_sliding_window). Built per pipeline stage (LlamaModel.build_stages)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.layers.norm import RMSNorm
from shoal.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)


def rope_layers(cfg: Any) -> list[bool]:
    """Whether each layer applies the rotary: no_rope_layers, else transformers' default of
    a NoPE layer every no_rope_layer_interval layers."""
    n = cfg.num_hidden_layers
    flags = getattr(cfg, "no_rope_layers", None)
    if flags is None:
        interval = int(getattr(cfg, "no_rope_layer_interval", 4))
        return [(i + 1) % interval != 0 for i in range(n)]
    if len(flags) < n:
        raise ValueError(f"no_rope_layers has {len(flags)} entries; the model has {n} layers")
    return [bool(f) for f in flags[:n]]


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: Any, dtype: torch.dtype, layer: int, use_rope: bool,
                 use_triton_ops: bool = True):
        nn.Module.__init__(self)
        ops = use_triton_ops
        self.self_attn = LlamaAttention(cfg, dtype, qk_norm=False, qkv_bias=False,
                                        use_triton_ops=ops, layer=layer, use_rope=use_rope)
        self.mlp = LlamaMLP(cfg, dtype, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class SmolLM3Model(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build its own layers
        rope = rope_layers(cfg)
        self.build_stages(
            cfg, dtype, lambda i: SmolLM3DecoderLayer(cfg, dtype, i, rope[i], use_triton_ops),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops))


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return SmolLM3Model(hf_config, dtype, use_triton_ops)

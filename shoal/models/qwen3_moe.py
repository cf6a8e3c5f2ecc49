"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 block (q/k RMSNorm, no qkv bias) with
the MLP replaced by a sparse mixture of experts on the layers transformers makes sparse:
every `decoder_sparse_step`-th layer not listed in `mlp_only_layers`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shoal.layers.moe.layer import FusedMoE
from shoal.layers.moe.router import TopKRouter
from shoal.layers.norm import RMSNorm
from shoal.models.expert_weights import load_expert_tensors
from shoal.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)


def is_sparse_layer(cfg: Any, layer_idx: int) -> bool:
    """transformers' rule (Qwen3MoeDecoderLayer): sparse unless listed in mlp_only_layers."""
    only = getattr(cfg, "mlp_only_layers", None) or []
    step = getattr(cfg, "decoder_sparse_step", 1)
    return layer_idx not in only and cfg.num_experts > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        self.gate = TopKRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                               bool(getattr(cfg, "norm_topk_prob", False)), dtype,
                               use_triton_ops)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                params_dtype=dtype, use_triton_ops=use_triton_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's forward; only the MLP differs."""

    def __init__(self, cfg: Any, dtype: torch.dtype, layer_idx: int,
                 use_triton_ops: bool = True):
        nn.Module.__init__(self)  # not Llama's __init__: it would allocate a dense MLP first
        ops = use_triton_ops
        self.self_attn = LlamaAttention(cfg, dtype, qk_norm=True, qkv_bias=False,
                                        use_triton_ops=ops, layer=layer_idx)
        self.mlp = (Qwen3MoeSparseBlock(cfg, dtype, ops) if is_sparse_layer(cfg, layer_idx)
                    else LlamaMLP(cfg, dtype, ops))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class Qwen3MoeModel(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build dense layers
        self.build_stages(cfg, dtype, lambda i: Qwen3MoeDecoderLayer(cfg, dtype, i,
                                                                     use_triton_ops),
                          lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                          use_triton_ops))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True  # as Qwen3 (the decoder layers above set it themselves)

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return Qwen3MoeModel(hf_config, dtype, use_triton_ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Expert tensors go into the stacked w13 / w2 parameters; the rest load as in Llama."""
        loaded: set[str] = set()
        rest = super().load_weights(load_expert_tensors(
            weights, dict(self.named_parameters()), loaded, type(self).__name__))
        return loaded | rest  # super() consumed the generator, which filled `loaded`

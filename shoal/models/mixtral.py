"""Mixtral (Mixtral-8x7B, 8x22B): Mistral's attention with every MLP a sparse mixture of
experts: softmax over all experts, the top k, their weights renormalized to sum to one.

Checkpoints name the block `block_sparse_moe` and each expert's projections w1 (gate), w3
(up), w2 (down); transformers 5 names it `mlp` with the experts stacked (gate_up_proj,
down_proj). Both load into FusedMoE's stacked parameters (shoal/models/expert_weights.py).
Built per pipeline stage (LlamaModel.build_stages). LoRA adapters of the experts use
transformers 5's names (mlp.experts: shoal/lora/expert_adapter.py)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.layers.moe.layer import FusedMoE
from shoal.layers.moe.router import TopKRouter
from shoal.layers.norm import RMSNorm
from shoal.models.expert_weights import load_expert_tensors
from shoal.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# model.layers.N.mlp.experts.E.w1.weight (after the block's rename): one expert's projection
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.\d+)\.(w1|w2|w3)\.weight$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def checkpoint_to_hf_names(weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """Mixtral checkpoint names as transformers 5 (and load_expert_tensors) spell them:
    block_sparse_moe -> mlp, experts.E.w1/w3/w2 -> experts.E.gate_proj/up_proj/down_proj."""
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if m := _EXPERT.match(name):
            name = f"{m[1]}.{_PROJ[m[2]]}.weight"
        yield name, tensor


class MixtralSparseBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        self.gate = TopKRouter(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok,
                               renormalize=True, params_dtype=dtype,
                               use_triton_ops=use_triton_ops)
        self.experts = FusedMoE(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size,
                                params_dtype=dtype, use_triton_ops=use_triton_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's forward; the MLP is the sparse block."""

    def __init__(self, cfg: Any, dtype: torch.dtype, layer: int, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # not Llama's __init__: it would allocate a dense MLP first
        ops = use_triton_ops
        self.self_attn = LlamaAttention(cfg, dtype, qk_norm=False, qkv_bias=False,
                                        use_triton_ops=ops, layer=layer)
        self.mlp = MixtralSparseBlock(cfg, dtype, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class MixtralModel(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build dense layers
        self.build_stages(
            cfg, dtype, lambda i: MixtralDecoderLayer(cfg, dtype, i, use_triton_ops),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops))


class MixtralForCausalLM(LlamaForCausalLM):
    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return MixtralModel(hf_config, dtype, use_triton_ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Expert tensors (either layout) go into the stacked w13 / w2 parameters; the rest
        load as in Llama."""
        loaded: set[str] = set()
        rest = super().load_weights(load_expert_tensors(
            checkpoint_to_hf_names(self.stage_tensors(weights)), dict(self.named_parameters()),
            loaded,
            type(self).__name__))
        return loaded | rest  # super() consumed the generator, which filled `loaded`

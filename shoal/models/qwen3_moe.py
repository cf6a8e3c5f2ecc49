"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 block (q/k RMSNorm, no qkv bias) with
the MLP replaced by a sparse mixture of experts on the layers transformers makes sparse:
every `decoder_sparse_step`-th layer not listed in `mlp_only_layers`."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.layers.embedding import VocabParallelEmbedding
from shoal.layers.moe.layer import FusedMoE
from shoal.layers.moe.router import TopKRouter
from shoal.layers.norm import RMSNorm
from shoal.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

# model.layers.N.mlp.experts.E.gate_proj.weight: one expert's projection, as checkpoints store it.
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
# model.layers.N.mlp.experts.gate_up_proj: all experts stacked, transformers 5's in-memory layout.
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_SHARD = {"gate": "w1", "up": "w3", "down": "w2"}


def is_sparse_layer(cfg: Any, layer_idx: int) -> bool:
    """transformers' rule (Qwen3MoeDecoderLayer): sparse unless listed in mlp_only_layers."""
    only = getattr(cfg, "mlp_only_layers", None) or []
    step = getattr(cfg, "decoder_sparse_step", 1)
    return layer_idx not in only and cfg.num_experts > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        self.gate = TopKRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                               bool(getattr(cfg, "norm_topk_prob", False)), dtype)
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
                                        use_triton_ops=ops)
        self.mlp = (Qwen3MoeSparseBlock(cfg, dtype, ops) if is_sparse_layer(cfg, layer_idx)
                    else LlamaMLP(cfg, dtype, ops))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class Qwen3MoeModel(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build dense layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(
            Qwen3MoeDecoderLayer(cfg, dtype, i, use_triton_ops)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True  # as Qwen3 (the decoder layers above set it themselves)

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return Qwen3MoeModel(hf_config, dtype, use_triton_ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Expert tensors go into the stacked w13 / w2 parameters; the rest load as in Llama."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def load_expert(prefix: str, proj: str, expert: int, tensor: torch.Tensor) -> None:
            name = f"{prefix}.{'w2' if proj == 'down' else 'w13'}_weight"
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint expert tensor for {name!r} has no matching "
                                 f"parameter in {type(self).__name__}")
            param.weight_loader(param, tensor.to(param.dtype), expert, _SHARD[proj])
            loaded.add(name)

        def dense() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if m := _EXPERT.match(name):
                    load_expert(m[1], m[3], int(m[2]), tensor)
                elif m := _STACKED.match(name):
                    for e, t in enumerate(tensor.unbind(0)):
                        if m[2] == "down_proj":
                            load_expert(m[1], "down", e, t)
                        else:
                            gate, up = t.chunk(2, dim=0)
                            load_expert(m[1], "gate", e, gate)
                            load_expert(m[1], "up", e, up)
                else:
                    yield name, tensor

        rest = super().load_weights(dense())  # runs dense(), which fills `loaded` on the way
        return loaded | rest

"""IBM Granite (Granite 3.x dense): the Llama block with four scalars from the config: the
token embeddings times embedding_multiplier, each branch output (attention, MLP) times
residual_multiplier before it joins the residual stream, attention_multiplier as the softmax
scale (not head_dim ** -0.5), and the logits divided by logits_scaling. attention_bias puts
a bias on q, k, v and o alike, as transformers' Llama attention does. Built per pipeline
stage (LlamaModel.build_stages): the embedding multiplier applies on the first stage, the logits
scaling where the logits are computed (stage 0, which holds lm_head).

GraniteMoe (shoal/models/granitemoe.py) reuses these pieces around its experts."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from shoal.layers.linear import RowParallelLinear
from shoal.layers.norm import RMSNorm
from shoal.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)


class GraniteAttention(LlamaAttention):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool, *, layer: int):
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, dtype, qk_norm=False, qkv_bias=bias,
                         use_triton_ops=use_triton_ops, layer=layer)
        if bias:  # Llama's rule gives o_proj no bias beside a qkv bias (Qwen2's layout)
            self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim,
                                            cfg.hidden_size, bias=True, params_dtype=dtype)
        self.attn.scale = float(cfg.attention_multiplier)


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer with both branch outputs scaled by residual_multiplier (the
    residual stream is carried beside the branch output, and each add fuses into the norm
    that follows)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, layer: int, use_triton_ops: bool = True):
        nn.Module.__init__(self)
        ops = use_triton_ops
        self.self_attn = GraniteAttention(cfg, dtype, ops, layer=layer)
        self.add_feed_forward(cfg, dtype, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.residual_multiplier = float(cfg.residual_multiplier)

    def add_feed_forward(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool) -> None:
        """The feed-forward block, under its checkpoint name (GraniteMoe's differs)."""
        self.mlp = LlamaMLP(cfg, dtype, use_triton_ops)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                md: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, md) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    layer_cls: ClassVar[type[GraniteDecoderLayer]] = GraniteDecoderLayer

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build its own layers
        self.embedding_multiplier = float(cfg.embedding_multiplier)
        self.build_stages(
            cfg, dtype, lambda i: self.layer_cls(cfg, dtype, i, use_triton_ops),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: Any,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.is_first:  # transformers scales given input embeddings too
            embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            inputs_embeds = embeds * self.embedding_multiplier
        return super().forward(input_ids, positions, md, intermediate, inputs_embeds)


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__(hf_config, dtype, use_triton_ops=use_triton_ops)
        self.logits_scaling = float(hf_config.logits_scaling)

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return GraniteModel(hf_config, dtype, use_triton_ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden) / self.logits_scaling

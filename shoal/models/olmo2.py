"""OLMo 2 (Olmo2ForCausalLM): the Llama block with its norms moved after each branch.

What differs from Llama (shoal/models/llama.py): no norm before attention or the MLP; each
branch's output is RMS-normed before it joins the residual stream (post_attention_layernorm,
post_feedforward_layernorm); and the queries and keys are RMS-normed over the whole
projection (all heads at once, weights of num_heads * head_dim) before the rotary, not per
head. Under tensor parallelism a rank holds some heads of that projection, so the norm's sum
of squares is all-reduced over the ranks (each replica of a shared KV head counted once).

The residual stream is carried as (branch output, stream before it), as Llama's layers hand it
on, so the final norm still adds the last branch in its fused call; and so is the pair
between pipeline stages (LlamaModel.build_stages)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.layers.linear import RowParallelLinear
from shoal.layers.norm import RMSNorm, ShardedRMSNorm
from shoal.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)


def check_silu(cfg: Any, family: str) -> None:
    """The families here with Llama's MLP run SiLU(gate) * up (hidden_act "silu")."""
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{family}: hidden_act must be 'silu' (got {act!r})")


def attend(module: LlamaAttention, positions: torch.Tensor, q: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor, md: Any) -> torch.Tensor:
    """module's rotary on q and k (already normed), then its paged attention: [T, H, D]
    each. The rotary and the cache write fuse where the backend can (no norm passed to it)."""
    if module.attn.fuses_rope and positions.dim() == 1:
        return module.attn.forward_rope(positions, q, k, v, module.rotary_emb, None, None, md)
    q, k = module.rotary_emb(positions, q, k)
    return module.attn(q, k, v, md)


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True, *,
                 layer: int):
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, dtype, qk_norm=False, qkv_bias=bias,
                         use_triton_ops=use_triton_ops, layer=layer)
        if bias:  # Llama's o_proj has no bias beside a qkv bias; OLMo 2's has both
            self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim,
                                            cfg.hidden_size, bias=True, params_dtype=dtype)
        eps, d = cfg.rms_norm_eps, self.head_dim
        total_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.q_norm = ShardedRMSNorm(cfg.num_attention_heads * d, self.q_size, eps, dtype)
        self.k_norm = ShardedRMSNorm(total_kv * d, self.kv_size, eps, dtype,
                                     self.qkv_proj.kv_replicas)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, md: Any) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        t = hidden.shape[0]
        q = self.q_norm(q).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(t, self.num_kv_heads, self.head_dim)
        o = attend(self, positions, q, k, v.reshape(t, self.num_kv_heads, self.head_dim), md)
        return self.o_proj(o.reshape(t, self.q_size))


class Olmo2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True, *,
                 layer: int):
        nn.Module.__init__(self)  # not Llama's: it would build pre-norms
        self.self_attn = Olmo2Attention(cfg, dtype, use_triton_ops, layer=layer)
        self.mlp = LlamaMLP(cfg, dtype, use_triton_ops)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.post_attention_layernorm = RMSNorm(d, eps, dtype, use_triton_ops)
        self.post_feedforward_layernorm = RMSNorm(d, eps, dtype, use_triton_ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, md: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the MLP branch's normed output, the stream before it): their sum is the
        layer's output."""
        x = hidden if residual is None else hidden + residual
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, md))
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2Model(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build its own layers
        self.build_stages(
            cfg, dtype, lambda i: Olmo2DecoderLayer(cfg, dtype, use_triton_ops, layer=i),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops))


class Olmo2ForCausalLM(LlamaForCausalLM):
    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        check_silu(hf_config, "OLMo 2")
        return Olmo2Model(hf_config, dtype, use_triton_ops)

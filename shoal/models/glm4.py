"""GLM-4 (Glm4ForCausalLM: GLM-4-9B-0414, GLM-Z1): the Llama block with four norms per layer
and a partial, interleaved rotary.

Rotary: only the first rot_dim = head_dim * partial_rotary_factor features of each query and
key head rotate, as interleaved pairs (x0, x1), (x2, x3), ...; shoal's rotary (and its
kernels) rotate the two halves of rot_dim. Loading reorders those rows of q_proj and k_proj
(weight and bias: evens first, then odds), which turns one into the other and leaves q.k, and
so every output, unchanged (the keys are cached in the reordered layout).

Norms: input_layernorm before attention, post_self_attn_layernorm on its output before the
residual add, post_attention_layernorm before the MLP and post_mlp_layernorm on its output
(Gemma's sandwich, under GLM's names). The MLP's gate and up projections are one checkpoint
tensor, gate_up_proj ([gate; up] rows), split into the fused parameter's two shards so that
tensor parallelism slices each. q/k/v carry a bias (attention_bias), o_proj none. Built per
pipeline stage (LlamaModel.build_stages).

LoRA: PEFT adapts gate_up_proj as one module (lora_fused_modules: each shard reads its rows of
the adapter's B), and an adapter's B of q_proj or k_proj has its rows reordered as the weights'
are (adapt_lora_b), so that B A x lands on the rows it adapts.

Glm4Attention is also GLM-4.5 MoE's (shoal/models/glm4_moe.py), whose partial rotary rotates
halves (no reordering there) and which may norm each query and key head."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.layers.attention import Attention
from shoal.layers.linear import QKVParallelLinear, RowParallelLinear
from shoal.layers.norm import RMSNorm
from shoal.layers.rotary import get_rope, rope_parameters
from shoal.models.deepseek_v2 import deinterleave_rows
from shoal.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel, layer_sliding_window
from shoal.models.olmo2 import check_silu


def head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def rotary_dim(cfg: Any) -> int:
    """The rotated features of a head: head_dim * partial_rotary_factor (transformers 5 keeps
    the factor in rope_parameters, older configs beside it)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    return int(head_dim(cfg) * float(factor))


class Glm4Attention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True, *,
                 layer: int, qk_norm: bool = False):
        """qk_norm: RMSNorm on each query and key head before the rotary (GLM-4.5's
        use_qk_norm)."""
        super().__init__()
        total_heads = cfg.num_attention_heads
        total_kv = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, total_heads, total_kv,
                                          bias=bool(getattr(cfg, "attention_bias", False)),
                                          params_dtype=dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, cfg.hidden_size, bias=False,
                                        params_dtype=dtype)
        theta, scaling = rope_parameters(cfg)
        self.rotary_emb = get_rope(self.head_dim, cfg.max_position_embeddings, theta, scaling,
                                   use_triton_ops=use_triton_ops, rot_dim=rotary_dim(cfg))
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, use_triton_ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, use_triton_ops)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              layer_sliding_window(cfg, layer))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, md: Any) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.attn.fuses_rope and positions.dim() == 1:  # norms, rotary, cache write fused
            o = self.attn.forward_rope(positions, q, k, v, self.rotary_emb, self.q_norm,
                                       self.k_norm, md)
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
            o = self.attn(q, k, v, md)
        return self.o_proj(o.reshape(t, self.q_size))


class Glm4DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True, *,
                 layer: int):
        super().__init__()
        self.self_attn = Glm4Attention(cfg, dtype, use_triton_ops, layer=layer)
        self.mlp = LlamaMLP(cfg, dtype, use_triton_ops)
        d, eps, ops = cfg.hidden_size, cfg.rms_norm_eps, use_triton_ops
        self.input_layernorm = RMSNorm(d, eps, dtype, ops)
        self.post_self_attn_layernorm = RMSNorm(d, eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype, ops)
        self.post_mlp_layernorm = RMSNorm(d, eps, dtype, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, md: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama's hand-off: the stream is hidden + residual, each add fused into the norm
        that follows it."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden, md))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4Model(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build its own layers
        self.build_stages(
            cfg, dtype, lambda i: Glm4DecoderLayer(cfg, dtype, use_triton_ops, layer=i),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops))


def split_gate_up(weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused ...mlp.gate_up_proj.weight ([gate; up] rows) as the two tensors the fused
    parameter's shards take (named as Llama's checkpoints name them)."""
    for name, tensor in weights:
        if name.endswith(".mlp.gate_up_proj.weight"):
            gate, up = tensor.chunk(2, dim=0)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, tensor


# the rows each reorders: q_proj's and k_proj's (weight, bias, a LoRA adapter's B)
_ROTATED = (".self_attn.q_proj", ".self_attn.k_proj")


class Glm4ForCausalLM(LlamaForCausalLM):
    lora_fused_modules: ClassVar[frozenset[str]] = frozenset({"gate_up_proj"})

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        check_silu(hf_config, "GLM-4")
        return Glm4Model(hf_config, dtype, use_triton_ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._halves(split_gate_up(weights)))

    def _halves(self, weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """q_proj and k_proj rows reordered so that interleaved rotary pairs become halves."""
        d, rot = head_dim(self.config), rotary_dim(self.config)
        for name, tensor in weights:
            if name.endswith(tuple(f"{m}.{p}" for m in _ROTATED for p in ("weight", "bias"))):
                tensor = deinterleave_rows(tensor, 0, rot, d)
            yield name, tensor

    def adapt_lora_b(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's B [out, r] of checkpoint module `module`, its rows in the order the
        loaded weights' are (shoal/lora/layers.py calls it)."""
        if not module.endswith(_ROTATED):
            return b
        return deinterleave_rows(b, 0, rotary_dim(self.config), head_dim(self.config))

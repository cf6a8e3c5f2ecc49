"""Cohere Command-R (CohereForCausalLM): attention and the MLP run in parallel off one norm.

Each layer is x + attn(ln(x)) + mlp(ln(x)) with a single input_layernorm, a LayerNorm without a
bias (mean subtracted, unlike RMSNorm); the final norm is one too. The logits are multiplied by
config.logit_scale and the embeddings are tied. The rotary is interleaved over the whole head:
loading reorders each query and key head's rows (evens first, then odds) so that shoal's
rotary, which rotates halves, computes the same q.k. With use_qk_norm (Command-R+), each query
and key head is LayerNormed before the rotary with weights of its own ([heads, head_dim],
reordered the same way and split over tensor-parallel ranks as the heads are). The MLP is
Llama's SwiGLU; o_proj has a bias when q/k/v have one (attention_bias). Built per pipeline
stage (LlamaModel.build_stages); the logit scale applies where the logits are computed (stage
0, which holds lm_head). A LoRA adapter's B of q_proj or k_proj is reordered as their weights
are (adapt_lora_b)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shoal.distributed.parallel_state import get_tp_rank
from shoal.layers.linear import RowParallelLinear, default_weight_loader
from shoal.layers.norm import ResidualLayerNorm
from shoal.models.deepseek_v2 import deinterleave_rows
from shoal.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from shoal.models.olmo2 import attend, check_silu


class HeadLayerNorm(nn.Module):
    """LayerNorm over each head's features with weights per head: x [T, H, D], weight [H, D]
    (this rank's heads: rows [slot * H, (slot + 1) * H) of the checkpoint's)."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, dtype: torch.dtype,
                 slot: int):
        super().__init__()
        self.eps, self.slot = eps, slot
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.slot * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), x.shape[-1:], eps=self.eps)
        return (y * self.weight.float()).to(x.dtype)


class CohereAttention(LlamaAttention):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True, *,
                 layer: int):
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, dtype, qk_norm=False, qkv_bias=bias,
                         use_triton_ops=use_triton_ops, layer=layer)
        if bias:  # Llama's o_proj has no bias beside a qkv bias; Cohere's has both
            self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim,
                                            cfg.hidden_size, bias=True, params_dtype=dtype)
        self.use_qk_norm = bool(getattr(cfg, "use_qk_norm", False))
        if self.use_qk_norm:
            eps, d, rank = cfg.layer_norm_eps, self.head_dim, get_tp_rank()
            self.q_norm = HeadLayerNorm(self.num_heads, d, eps, dtype, rank)
            self.k_norm = HeadLayerNorm(self.num_kv_heads, d, eps, dtype,
                                        rank // self.qkv_proj.kv_replicas)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, md: Any) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        o = attend(self, positions, q, k, v.reshape(t, self.num_kv_heads, self.head_dim), md)
        return self.o_proj(o.reshape(t, self.q_size))


class CohereDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True, *,
                 layer: int):
        super().__init__()
        self.self_attn = CohereAttention(cfg, dtype, use_triton_ops, layer=layer)
        self.mlp = LlamaMLP(cfg, dtype, use_triton_ops)
        self.input_layernorm = ResidualLayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, bias=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, md: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (both branches' sum, the stream before them), Llama's hand-off."""
        if residual is None:
            residual, x = hidden, self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        return self.self_attn(positions, x, md) + self.mlp(x), residual


class CohereModel(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build its own layers
        self.build_stages(
            cfg, dtype, lambda i: CohereDecoderLayer(cfg, dtype, use_triton_ops, layer=i),
            lambda: ResidualLayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, bias=False))


class CohereForCausalLM(LlamaForCausalLM):
    # q/k/v fuse into qkv_proj, gate/up into gate_up_proj (Llama's)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = (
        LlamaForCausalLM.packed_modules_mapping)

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__(hf_config, dtype, use_triton_ops=use_triton_ops)
        scale = getattr(hf_config, "logit_scale", None)
        self.logit_scale = 1.0 if scale is None else float(scale)

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        check_silu(hf_config, "Cohere")
        return CohereModel(hf_config, dtype, use_triton_ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden) * self.logit_scale

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._halves(weights))

    def _halves(self, weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each query and key head's rows (and its norm weights) reordered so that interleaved
        rotary pairs become halves."""
        d = self._head_dim()
        for name, tensor in weights:
            if name.endswith((".self_attn.q_proj.weight", ".self_attn.q_proj.bias",
                              ".self_attn.k_proj.weight", ".self_attn.k_proj.bias")):
                tensor = deinterleave_rows(tensor, 0, d, d)
            elif name.endswith((".self_attn.q_norm.weight", ".self_attn.k_norm.weight")):
                tensor = deinterleave_rows(tensor.reshape(-1), 0, d, d).view_as(tensor)
            yield name, tensor

    def _head_dim(self) -> int:
        cfg = self.config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def adapt_lora_b(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's B [out, r] of checkpoint module `module`, its rows in the order the
        loaded weights' are (shoal/lora/layers.py calls it)."""
        if not module.endswith((".self_attn.q_proj", ".self_attn.k_proj")):
            return b
        d = self._head_dim()
        return deinterleave_rows(b, 0, d, d)

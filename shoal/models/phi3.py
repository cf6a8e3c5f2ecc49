"""Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM; Phi-4-mini with partial rotary): the Llama
block as transformers' Phi3 runs it, with two differences in what is loaded and one in the
rotary. The checkpoint stores q, k and v as one qkv_proj and gate and up as one gate_up_proj
(in that order): each is split into its projections so that tensor parallelism slices each
one by its own heads or rows. Only the first partial_rotary_factor of each head rotates.
LongRoPE ("longrope" rope scaling: per-frequency short and long factors, an attention factor
on cos and sin) is shoal/layers/rotary.py's, whose factor set is chosen once for the
model's context (see _longrope there). Built per pipeline stage (LlamaModel.build_stages).

LoRA: PEFT adapts the checkpoint's modules, the fused qkv_proj and gate_up_proj (one A, one B
over all their rows): lora_fused_modules tells shoal/lora/layers.py to read each part's rows
of that B."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

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


def rotary_dims(cfg: Any, head_dim: int) -> int:
    """The rotated dims of a head: head_dim times partial_rotary_factor (transformers 5 keeps
    it in rope_parameters, older configs beside them)."""
    params = getattr(cfg, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(cfg, "partial_rotary_factor", None) or 1.0
    rot = int(head_dim * factor)
    if not 0 < rot <= head_dim or rot % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives {rot} rotary dims of a "
                         f"{head_dim}-dim head; it must give an even number in (0, {head_dim}]")
    return rot


class Phi3DecoderLayer(LlamaDecoderLayer):
    """Llama's forward over attention with partial rotary."""

    def __init__(self, cfg: Any, dtype: torch.dtype, layer: int, use_triton_ops: bool = True):
        nn.Module.__init__(self)
        ops = use_triton_ops
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.self_attn = LlamaAttention(cfg, dtype, qk_norm=False, qkv_bias=False,
                                        use_triton_ops=ops, layer=layer,
                                        rot_dim=rotary_dims(cfg, head_dim))
        self.mlp = LlamaMLP(cfg, dtype, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class Phi3Model(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build its own layers
        self.build_stages(
            cfg, dtype, lambda i: Phi3DecoderLayer(cfg, dtype, i, use_triton_ops),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops))


class Phi3ForCausalLM(LlamaForCausalLM):
    lora_fused_modules: ClassVar[frozenset[str]] = frozenset({"qkv_proj", "gate_up_proj"})

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return Phi3Model(hf_config, dtype, use_triton_ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """The fused qkv_proj and gate_up_proj tensors as the separate projections
        packed_modules_mapping routes (each then sliced for this tensor-parallel rank)."""
        cfg = self.config
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        qkv_rows = [heads * head_dim, kv * head_dim, kv * head_dim]
        for name, tensor in weights:
            if name.endswith(".qkv_proj.weight"):
                if tensor.shape[0] != sum(qkv_rows):
                    raise ValueError(f"{name}: {tensor.shape[0]} rows, expected "
                                     f"{sum(qkv_rows)} (q, k and v)")
                for proj, part in zip(("q_proj", "k_proj", "v_proj"),
                                      tensor.split(qkv_rows, dim=0)):
                    yield name.replace(".qkv_proj.", f".{proj}."), part
            elif name.endswith(".gate_up_proj.weight"):
                if tensor.shape[0] != 2 * cfg.intermediate_size:
                    raise ValueError(f"{name}: {tensor.shape[0]} rows, expected "
                                     f"{2 * cfg.intermediate_size} (gate and up)")
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor

"""Gemma 2 (Gemma2ForCausalLM): Gemma 3's decoder (shoal/models/gemma3.py) less the q/k norms.

The same as Gemma 3: embeddings scaled by sqrt(hidden_size), four x * (1 + w) norms per layer
(input, post-attention, pre- and post-feedforward), a GELU-tanh gated MLP, the attention
scale query_pre_attn_scalar ** -0.5, sliding and full layers by config.layer_types (Gemma 2
alternates them), tied embeddings. What differs: no norm on the query and key heads, one rope
base for every layer, and two soft caps: each attention score becomes
attn_logit_softcapping * tanh(score / attn_logit_softcapping) (the paged attention layer's
softcap, which both the torch and the Triton attention backends apply, the latter in its
fused rotary path too), and the final logits
final_logit_softcapping * tanh(logits / final_logit_softcapping)."""

from __future__ import annotations

from typing import Any, ClassVar

from shoal.layers.rotary import rope_parameters
from shoal.models.gemma3 import (
    Gemma3Attention,
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3TextModel,
)


class Gemma2Attention(Gemma3Attention):
    qk_norm: ClassVar[bool] = False

    @staticmethod
    def layer_rope(cfg: Any, layer: int) -> tuple[float, dict[str, Any] | None]:
        return rope_parameters(cfg)  # one base for sliding and full layers


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    attention_cls: ClassVar[type[Gemma3Attention]] = Gemma2Attention


class Gemma2Model(Gemma3TextModel):
    layer_cls: ClassVar[type[Gemma3DecoderLayer]] = Gemma2DecoderLayer


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """compute_logits applies final_logit_softcapping (Gemma3ForCausalLM's final_softcap)."""

    model_cls: ClassVar[type[Gemma3TextModel]] = Gemma2Model

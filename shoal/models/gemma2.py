"""Gemma 2 (Gemma2ForCausalLM): Gemma 3's decoder layers (shoal/models/gemma3.py) less the q/k
norms, in Llama's per-stage stack (shoal/models/llama.py).

The same as Gemma 3: embeddings scaled by sqrt(hidden_size), four x * (1 + w) norms per layer
(input, post-attention, pre- and post-feedforward), a GELU-tanh gated MLP, the attention
scale query_pre_attn_scalar ** -0.5, sliding and full layers by config.layer_types (Gemma 2
alternates them), tied embeddings. What differs: no norm on the query and key heads, one rope
base for every layer, and two soft caps: each attention score becomes
attn_logit_softcapping * tanh(score / attn_logit_softcapping) (the paged attention layer's
softcap, which both the torch and the Triton attention backends apply, the latter in its
fused rotary path too), and the final logits
final_logit_softcapping * tanh(logits / final_logit_softcapping).

Pipeline parallelism (LlamaModel.build_stages): the scaled embedding on the first stage, the
final norm on the last; lm_head, tied to the embedding, and the final cap where the logits are
computed (stage 0, which samples and also holds the embedding)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from shoal.layers.norm import OffsetRMSNorm
from shoal.layers.rotary import rope_parameters
from shoal.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, final_softcap
from shoal.models.llama import LlamaForCausalLM, LlamaModel


class Gemma2Attention(Gemma3Attention):
    qk_norm: ClassVar[bool] = False

    @staticmethod
    def layer_rope(cfg: Any, layer: int) -> tuple[float, dict[str, Any] | None]:
        return rope_parameters(cfg)  # one base for sliding and full layers


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    attention_cls: ClassVar[type[Gemma3Attention]] = Gemma2Attention

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, md: Any, spans: Any = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma 3's layer, called as Llama's stack calls its layers (no image spans)."""
        return super().forward(positions, hidden, residual, md, spans)


class Gemma2Model(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build its own layers
        self.build_stages(
            cfg, dtype, lambda i: Gemma2DecoderLayer(cfg, dtype, use_triton_ops, layer=i),
            lambda: OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops))
        # rounded to the model dtype first, as transformers multiplies
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: Any,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.is_first and inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        return super().forward(input_ids, positions, md, intermediate, inputs_embeds)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Llama's per-stage model and loader (q/k/v and gate/up fused, lm_head tied)."""

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return Gemma2Model(hf_config, dtype, use_triton_ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return final_softcap(self.config, self.lm_head.compute_logits(hidden))

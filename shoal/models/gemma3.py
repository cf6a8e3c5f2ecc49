"""Gemma 3's text decoder (Gemma3ForCausalLM; also the language model of the vision-language
Gemma3ForConditionalGeneration, shoal/models/gemma3_vl.py).

What differs from the Llama block (shoal/models/llama.py): the token embeddings are scaled by
sqrt(hidden_size); every norm is Gemma's x * (1 + w) (OffsetRMSNorm: the loader adds the 1,
so the norms run as plain RMSNorms, kernels included), with four per layer (input, post-
attention, pre- and post-feedforward) and one on each query and key head; the MLP is a
GELU-tanh gated one; the attention scale is query_pre_attn_scalar ** -0.5; layers are
`sliding_attention` (a window and the local rope base) or `full_attention` (the global base,
and its scaling) by config.layer_types. Parameter names are the checkpoint's (q/k/v and
gate/up into fused parameters); lm_head is tied to the embeddings. One pipeline stage.

Gemma 2 (shoal/models/gemma2.py) is this model without the q/k norms, with one rope base for
every layer and with attention and final logit soft-capping: it subclasses the classes here
through their class attributes (attention_cls, layer_cls, model_cls) and Gemma3Attention's
qk_norm and layer_rope."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shoal.distributed.parallel_state import get_pp_world_size
from shoal.layers.attention import Attention
from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from shoal.layers.norm import OffsetRMSNorm
from shoal.layers.rotary import get_rope, rope_parameters
from shoal.models.llama import LlamaForCausalLM, layer_sliding_window
from shoal.models.vlm_common import load_packed

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")


def layer_rope(cfg: Any, layer: int) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of the layer's type: transformers 5 keeps one rope_parameters dict per
    layer type; older configs have rope_theta (global) and rope_local_base_freq (local)."""
    kind = cfg.layer_types[layer]
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(kind), dict):
        return rope_parameters(SimpleNamespace(rope_parameters=params[kind],
                                               max_position_embeddings=cfg.max_position_embeddings))
    if kind == "sliding_attention":
        return float(getattr(cfg, "rope_local_base_freq", 10000.0)), None
    return rope_parameters(cfg)


class Gemma3Attention(nn.Module):
    # RMSNorm (x * (1 + w)) on each query and key head before the rotary
    qk_norm: ClassVar[bool] = True

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool, *, layer: int):
        super().__init__()
        total_heads, total_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, total_heads, total_kv,
                                          bias=bias, params_dtype=dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, cfg.hidden_size, bias=bias,
                                        params_dtype=dtype)
        theta, scaling = self.layer_rope(cfg, layer)
        self.rotary_emb = get_rope(self.head_dim, cfg.max_position_embeddings, theta, scaling,
                                   use_triton_ops=use_triton_ops)
        self.q_norm: OffsetRMSNorm | None = None
        self.k_norm: OffsetRMSNorm | None = None
        if self.qk_norm:
            eps = cfg.rms_norm_eps
            self.q_norm = OffsetRMSNorm(self.head_dim, eps, dtype, use_triton_ops)
            self.k_norm = OffsetRMSNorm(self.head_dim, eps, dtype, use_triton_ops)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              layer_sliding_window(cfg, layer),
                              softcap=getattr(cfg, "attn_logit_softcapping", None))
        self.attn.scale = float(cfg.query_pre_attn_scalar) ** -0.5  # not head_dim's

    @staticmethod
    def layer_rope(cfg: Any, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of the layer: Gemma 3's per layer type."""
        return layer_rope(cfg, layer)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, md: Any,
                spans: Any = None) -> torch.Tensor:
        """spans: the step's image spans, whose rows attend bidirectionally among themselves
        (the vision-language model's prefill); None: plain causal attention."""
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # norms, rotary, cache write fused; the soft cap goes along (a backend without one
        # was refused when bound)
        if self.attn.fuses_rope and spans is None:
            o = self.attn.forward_rope(positions, q, k, v, self.rotary_emb, self.q_norm,
                                       self.k_norm, md)
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
            o = self.attn(q, k, v, md)
            if spans is not None:
                o = spans.attend(self.attn, q, o, positions, md)
        return self.o_proj(o.reshape(t, self.q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype):
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act not in _GELU_TANH:
            raise ValueError(f"unsupported Gemma 3 activation {act!r}")
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter],
                                                       bias=False, params_dtype=dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=False,
                                           params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    attention_cls: ClassVar[type[Gemma3Attention]] = Gemma3Attention

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool, *, layer: int):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, dtype, use_triton_ops, layer=layer)
        self.mlp = Gemma3MLP(cfg, dtype)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(d, eps, dtype, use_triton_ops)
        self.post_attention_layernorm = OffsetRMSNorm(d, eps, dtype, use_triton_ops)
        self.pre_feedforward_layernorm = OffsetRMSNorm(d, eps, dtype, use_triton_ops)
        self.post_feedforward_layernorm = OffsetRMSNorm(d, eps, dtype, use_triton_ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, md: Any, spans: Any,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried unnormed beside the branch output, so that each
        residual add fuses into the norm that follows it."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, md, spans))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3TextModel(nn.Module):
    layer_cls: ClassVar[type[Gemma3DecoderLayer]] = Gemma3DecoderLayer

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        if getattr(cfg, "use_bidirectional_attention", False):  # EmbeddingGemma's encoder
            raise NotImplementedError("Gemma 3 with use_bidirectional_attention")
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        # rounded to the model dtype first, as transformers multiplies (bf16: 55.5, not 55.43)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype),
                             persistent=False)
        self.layers = nn.ModuleList(self.layer_cls(cfg, dtype, use_triton_ops, layer=i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: Any,
                inputs_embeds: torch.Tensor | None = None,
                spans: Any = None) -> torch.Tensor:
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, md, spans)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def final_softcap(cfg: Any, logits: torch.Tensor) -> torch.Tensor:
    """logits capped as cap * tanh(logits / cap) when the config sets final_logit_softcapping."""
    cap = getattr(cfg, "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(nn.Module):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = (
        LlamaForCausalLM.packed_modules_mapping)
    model_cls: ClassVar[type[Gemma3TextModel]] = Gemma3TextModel

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__()
        if get_pp_world_size() > 1:
            raise NotImplementedError(f"{type(self).__name__} runs on one pipeline stage")
        self.config = hf_config
        self.hidden_size = hf_config.hidden_size
        self.model = self.model_cls(hf_config, dtype, use_triton_ops)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return final_softcap(self.config, self.lm_head.compute_logits(hidden))

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_packed(self, weights, self.packed_modules_mapping, self.tie_word_embeddings)

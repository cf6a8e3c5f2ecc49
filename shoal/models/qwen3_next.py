"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet layers (shoal/layers/
gated_delta_net.py) and gated full-attention layers, as config.layer_types lists them (three
linear layers to one full one), with sparse MoE MLPs whose output adds a sigmoid-gated shared
expert. The full-attention layers project a per-head output gate beside each query (q_proj
is [heads x 2 x head_dim]: query, then gate), norm q and k per head, rotate only the first
partial_rotary_factor of each head, and scale their output by sigmoid(gate). Every RMSNorm
but the linear layers' gated one stores weight - 1 (OffsetRMSNorm).

Qwen3.5 (shoal/models/qwen3_5.py) is the same stack with other in-projections and dense or
MoE MLPs. A model of both kinds of layer keeps KV blocks for the attention layers and one
recurrent state per request in each linear layer, in the same pool (kv_cache_spec.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.core.kv_cache_spec import state_block_size
from shoal.layers.activation import sigmoid_gate
from shoal.layers.attention import Attention
from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.gated_delta_net import GatedDeltaNet
from shoal.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from shoal.layers.moe.layer import FusedMoE
from shoal.layers.moe.router import TopKRouter
from shoal.layers.moe.shared_experts import gated_shared_expert_of
from shoal.layers.norm import OffsetRMSNorm
from shoal.layers.rotary import get_rope, rope_parameters
from shoal.models.expert_weights import load_expert_tensors
from shoal.models.llama import LlamaForCausalLM, LlamaMLP


def partial_rotary_factor(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor",
                            getattr(cfg, "partial_rotary_factor", 1.0)))


def hybrid_block_size(cfg: Any, dtype_bytes: int, tp: int) -> int:
    """The block size whose attention page (2 planes of this rank's KV heads) holds one
    linear layer's state (float32 words) on this rank."""
    nk, nv = cfg.linear_num_key_heads // tp, cfg.linear_num_value_heads // tp
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    state = 4 * ((2 * nk * dk + nv * dv) * (cfg.linear_conv_kernel_dim - 1) + nv * dk * dv)
    kv_heads = max(1, cfg.num_key_value_heads // tp)
    return state_block_size(state, 2 * kv_heads * cfg.head_dim * dtype_bytes)


class GatedAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool):
        super().__init__()
        d = self.head_dim = cfg.head_dim
        # q_proj holds query and gate per head: as 2x the heads of the fused projection
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, 2 * cfg.num_attention_heads,
                                          cfg.num_key_value_heads,
                                          bias=getattr(cfg, "attention_bias", False),
                                          params_dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size,
                                        bias=getattr(cfg, "attention_bias", False),
                                        params_dtype=dtype)
        self.q_norm = OffsetRMSNorm(d, cfg.rms_norm_eps, dtype, use_triton_ops)
        self.k_norm = OffsetRMSNorm(d, cfg.rms_norm_eps, dtype, use_triton_ops)
        theta, scaling = rope_parameters(cfg)
        rot = int(d * partial_rotary_factor(cfg))
        self.rotary_emb = get_rope(d, cfg.max_position_embeddings, theta, scaling,
                                   use_triton_ops=use_triton_ops, rot_dim=rot)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d)
        self.use_triton_ops = use_triton_ops

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, md: Any) -> torch.Tensor:
        t, d = hidden.shape[0], self.head_dim
        q_size, kv_size = 2 * self.num_heads * d, self.num_kv_heads * d
        qg, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * d).split([d, d], dim=-1)
        k, v = k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)
        if self.attn.fuses_rope and positions.dim() == 1:
            # q/k norms, the partial rotary and the cache write in one kernel, on the strided
            # views (q in place), where the path below takes five at a decode step (q's
            # copy, two norms, the rotary, the cache write)
            o = self.attn.forward_rope(positions, q, k, v, self.rotary_emb, self.q_norm,
                                       self.k_norm, md)
        else:
            q = self.q_norm(q.contiguous())
            k = self.k_norm(k.contiguous())
            q, k = self.rotary_emb(positions, q, k)
            o = self.attn(q, k, v, md)
        return self.o_proj(sigmoid_gate(o, gate, self.use_triton_ops))


class SharedExpertMoE(nn.Module):
    """Routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x)). The
    shared expert joins the routed sum inside FusedMoE (shared_experts.py): at bf16 decode
    sizes within the experts' two launches, its gate too; elsewhere its own MLP and gate.
    Either way its partial sums are reduced with the routed experts' (one all-reduce)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool):
        super().__init__()
        self.gate = TopKRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                               bool(getattr(cfg, "norm_topk_prob", True)), dtype,
                               use_triton_ops)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                params_dtype=dtype, use_triton_ops=use_triton_ops)
        shared = _Sized(cfg, cfg.shared_expert_intermediate_size)
        self.shared_expert = LlamaMLP(shared, dtype, use_triton_ops)
        self.shared_expert.down_proj.reduce_results = False  # (FusedMoE's all-reduce sums it)
        self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        shared = gated_shared_expert_of(self.shared_expert, self.shared_expert_gate)
        return self.experts(x, weights, ids, shared=shared)


class _Sized:
    """cfg with another intermediate_size (the shared expert's MLP)."""

    def __init__(self, cfg: Any, size: int):
        self.hidden_size, self.intermediate_size = cfg.hidden_size, size


class HybridLayer(nn.Module):
    """A pre-norm decoder layer whose token mixer is a linear-attention layer (called on the
    hidden states) or an attention module (on positions too, its paged layer at .attn); the
    subclass builds them and says which module mixes (`mixer`)."""

    linear: bool

    @property
    def mixer(self) -> nn.Module:
        raise NotImplementedError

    @property
    def paged_layer(self) -> nn.Module:
        return self.mixer if self.linear else self.mixer.attn

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, md: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.mixer(hidden, md) if self.linear else self.mixer(positions, hidden, md)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class HybridDecoderLayer(HybridLayer):
    def __init__(self, cfg: Any, dtype: torch.dtype, layer: int, *, interleaved: bool,
                 sparse: bool, use_triton_ops: bool, kind: str | None = None):
        """kind: the token mixer, "linear_attention" or "full_attention" (default: the
        config's layer_types[layer]; the MTP layer past them is full attention)."""
        super().__init__()
        self.linear = (kind or cfg.layer_types[layer]) == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype, interleaved=interleaved)
        else:
            self.self_attn = GatedAttention(cfg, dtype, use_triton_ops)
        self.mlp = (SharedExpertMoE(cfg, dtype, use_triton_ops) if sparse
                    else LlamaMLP(cfg, dtype, use_triton_ops))
        eps = cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, eps, dtype, use_triton_ops)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, eps, dtype,
                                                      use_triton_ops)

    @property
    def mixer(self) -> nn.Module:  # (the checkpoint names them linear_attn and self_attn)
        return self.linear_attn if self.linear else self.self_attn


class HybridModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, layers: list[HybridDecoderLayer],
                 use_triton_ops: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # inputs_embeds: a multimodal step's rows (image rows placed: qwen3_5_vl.py)
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, md)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3NextForCausalLM(LlamaForCausalLM):
    interleaved = True  # Qwen3-Next's in_proj_qkvz / in_proj_ba
    # Checkpoint tensors beside the decoder (the MTP head's, loaded only as a drafter).
    skipped_prefixes: ClassVar[tuple[str, ...]] = ("mtp.",)

    def _build_model(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool) -> nn.Module:
        layers = [HybridDecoderLayer(cfg, dtype, i, interleaved=self.interleaved,
                                     sparse=self.sparse_layer(cfg, i),
                                     use_triton_ops=use_triton_ops)
                  for i in range(cfg.num_hidden_layers)]
        return HybridModel(cfg, dtype, layers, use_triton_ops)

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        nn.Module.__init__(self)
        self.config = hf_config
        self.hidden_size = hf_config.hidden_size
        self.model = self._build_model(hf_config, dtype, use_triton_ops)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def sparse_layer(cfg: Any, i: int) -> bool:
        """transformers' rule: sparse unless in mlp_only_layers, every decoder_sparse_step-th."""
        only = getattr(cfg, "mlp_only_layers", None) or []
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        return i not in only and getattr(cfg, "num_experts", 0) > 0 and (i + 1) % step == 0

    @staticmethod
    def block_size_for(cfg: Any, dtype_bytes: int, tp: int) -> int:
        """The smallest block size whose pages hold a linear layer's state (see
        kv_cache_spec.py); the engine raises the configured one to it."""
        return hybrid_block_size(cfg, dtype_bytes, tp)

    def forward_stage(self, *args: Any) -> Any:
        raise NotImplementedError("pipeline parallelism does not cover hybrid models")

    def attention_layers(self) -> list[nn.Module]:
        """The paged layers in order: full-attention layers and linear-attention layers (a
        LinearStateSpec each)."""
        return [layer.paged_layer for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        kept = ((n, t) for n, t in weights if not n.startswith(self.skipped_prefixes))
        rest = super().load_weights(load_expert_tensors(
            kept, dict(self.named_parameters()), loaded, type(self).__name__))
        return loaded | rest

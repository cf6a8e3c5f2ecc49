"""DeepSeek-V2 / V3 (and Kimi-K2, which is the V3 architecture): multi-head latent attention
over a latent KV cache, and a mixture of experts with shared experts and grouped routing.

Attention (MLA): queries come from q_proj, or from q_a_proj -> RMSNorm -> q_b_proj when the
config has a q_lora_rank; keys and values are compressed per token into one latent row,
kv_a_proj_with_mqa -> [kv_lora_rank | qk_rope_head_dim], whose first part is RMS-normed and
whose second is the rotated key shared by every head. The cache stores that row once per
token (LatentAttention). Attention runs in the weight-absorbed form for every token: each
head's non-rotary query is projected into the latent space through its slice of kv_b_proj
(W_UK), scored against whole latent rows, and the attention-weighted latents are projected to
the head's value through the other slice (W_UV). Decode reads 576 values per cached token
(V3) instead of 2 x 128 heads x 128-192.

Rotary: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; shoal's rotary (and its
Triton kernels) rotate the two halves of a head. Loading permutes the rotary rows of q_proj /
q_b_proj and kv_a_proj_with_mqa (evens first, then odds), which turns one into the other;
q.k, and so every output, is unchanged. YaRN scaling (the configs' rope_scaling) is in the
shared rotary table; its softmax correction in the scale.

MoE: layers from first_k_dense_replace on (every moe_layer_freq-th) are sparse: the routed
experts (FusedMoE, DeepseekRouter: V2's softmax greedy / group-limited greedy, V3's sigmoid
with the score-correction bias and group-limited top-k) plus n_shared_experts always-on
experts, summed with one tensor-parallel all-reduce; at decode sizes the bf16 decode experts
run the shared experts in their own launches (shoal/layers/moe/shared_experts.py). The
others are a dense SwiGLU MLP.

Tensor parallelism: heads split (q_b_proj / q_proj and kv_b_proj by output rows, o_proj by
input columns); the latent down-projections and their norms are replicated (every rank needs
the whole latent row); experts split as in FusedMoE.

Pipeline parallelism: the stack builds per stage as Llama's (LlamaModel.build_stages).

Multi-token-prediction layers (model.layers.{num_hidden_layers}...) are skipped on load."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.distributed.parallel_state import get_tp_world_size, tp_all_reduce
from shoal.layers.activation import SiluAndMul
from shoal.layers.latent_attention import LatentAttention
from shoal.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from shoal.layers.moe.deepseek_router import DeepseekRouter
from shoal.layers.moe.layer import FusedMoE
from shoal.layers.moe.shared_experts import shared_experts_of
from shoal.layers.norm import RMSNorm
from shoal.layers.ops.dispatch import use_triton
from shoal.layers.rotary import (
    RotaryEmbedding,
    get_rope,
    rope_parameters,
    yarn_softmax_scale,
)
from shoal.layers.shared_input_linear import SharedInputLinear
from shoal.models.expert_weights import load_expert_tensors
from shoal.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, PPMissingLayer

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def rope_is_interleaved(cfg: Any) -> bool:
    """V2 always rotates interleaved pairs; V3 unless its config says rope_interleave=False."""
    if getattr(cfg, "model_type", "") == "deepseek_v2":
        return True
    return bool(getattr(cfg, "rope_interleave", True))


def deinterleave_rows(t: torch.Tensor, start: int, rope_dim: int, period: int) -> torch.Tensor:
    """A copy of t whose rows [k * period + start, k * period + start + rope_dim) (the rotary
    rows of each head, or of the one latent row when period == len(t)) are reordered evens
    first, then odds."""
    order = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    out = t.clone()
    for base in range(0, t.shape[0], period):
        rows = base + start
        out[rows:rows + rope_dim] = t[rows + order]
    return out


class DeepseekMLA(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        self.total_heads = cfg.num_attention_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        tp = get_tp_world_size()
        if self.total_heads % tp:
            raise ValueError(f"num_attention_heads ({self.total_heads}) is not divisible by "
                             f"tensor_parallel_size ({tp})")
        qk_dim = self.nope + self.rope
        bias = bool(getattr(cfg, "attention_bias", False))
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(h, self.q_lora_rank, bias=bias, params_dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps, dtype, use_triton_ops)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, self.total_heads * qk_dim,
                                                 params_dtype=dtype)
            q_out = self.q_b_proj
        else:
            self.q_proj = ColumnParallelLinear(h, self.total_heads * qk_dim, params_dtype=dtype)
            q_out = self.q_proj
        self.num_heads = q_out.output_size_per_partition // qk_dim
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.rope, bias=bias,
                                                   params_dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps, dtype, use_triton_ops)
        # both read `hidden`: one GEMM while their weights stay dense (shared_input_linear.py)
        self.input_proj = (None if bias else SharedInputLinear(
            self.q_a_proj if self.q_lora_rank else self.q_proj, self.kv_a_proj_with_mqa))
        # Never run as a linear layer: its per-head slices are W_UK and W_UV (see w_uk/w_uv),
        # so it keeps a dense weight (no CPU int4 conversion).
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              self.total_heads * (self.nope + self.v_dim),
                                              params_dtype=dtype)
        self.kv_b_proj.weight_only = True
        self.o_proj = RowParallelLinear(self.total_heads * self.v_dim, h, bias=bias,
                                        params_dtype=dtype)
        theta, scaling = rope_parameters(cfg)
        self.rotary_emb = get_rope(self.rope, cfg.max_position_embeddings, theta, scaling,
                                   use_triton_ops=use_triton_ops)
        scale = yarn_softmax_scale(scaling, qk_dim ** -0.5)
        self.attn = LatentAttention(self.num_heads, self.kv_lora_rank, self.rope, scale)

    def _kv_b(self) -> torch.Tensor:
        return self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim,
                                          self.kv_lora_rank)

    @property
    def w_uk(self) -> torch.Tensor:
        """[H, nope, kv_lora_rank]: a head's non-rotary key is W_UK @ latent."""
        return self._kv_b()[:, :self.nope]

    @property
    def w_uv(self) -> torch.Tensor:
        """[H, kv_lora_rank, v_dim]: a head's value is latent @ W_UV."""
        return self._kv_b()[:, self.nope:].transpose(1, 2)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, md: Any) -> torch.Tensor:
        t = hidden.shape[0]
        q_resid = None
        q_first = self.q_a_proj if self.q_lora_rank else self.q_proj
        if self.input_proj is not None:
            q, kv_a = self.input_proj(hidden)
        else:
            q, kv_a = q_first(hidden), self.kv_a_proj_with_mqa(hidden)
        if self.q_lora_rank:
            q_resid = self.q_a_layernorm(q)
            q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(t, self.num_heads, self.nope + self.rope).split(
            [self.nope, self.rope], dim=-1)
        # [H, T, nope] @ [H, nope, L]: each head's query in the latent space.
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk)
        q_abs, latent = self.attention_inputs(q_lat, q_pe, kv_a, positions)
        select = self.select(hidden, q_resid, positions, md)
        o = self.attn(q_abs, latent, md, select)  # [T, H, L]
        o = torch.bmm(o.transpose(0, 1), self.w_uv)  # [H, T, v]
        return self.o_proj(o.transpose(0, 1).reshape(t, self.num_heads * self.v_dim))

    def attention_inputs(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_a: torch.Tensor,
                         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(absorbed queries [T, H, L + rope], latent rows [T, L + rope]) from q_lat [H, T, L],
        the queries' rotary parts q_pe [T, H, rope] and the kv_a projection [T, L + rope]: one
        Triton launch on CUDA (layers/ops/mla_inputs.py), the modules' ops elsewhere."""
        table = self.rope_table()
        if use_triton(kv_a, self.kv_a_layernorm.use_triton_ops) and table is not False:
            from shoal.layers.ops.mla_inputs import mla_inputs

            return mla_inputs(q_lat, q_pe, kv_a, positions, table, self.kv_a_layernorm.weight,
                              self.kv_a_layernorm.eps)
        t = kv_a.shape[0]
        c, k_pe = kv_a.split([self.kv_lora_rank, self.rope], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(),
                                     k_pe.contiguous().view(t, 1, self.rope))
        latent = torch.cat([self.kv_a_layernorm(c.contiguous()), k_pe.view(t, self.rope)], -1)
        return torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1), latent

    def rope_table(self) -> torch.Tensor | None | bool:
        """The fused kernel's rotary table: the module's cos/sin rows where it rotates all
        rope dims the standard way, None where it does not rotate (NoPE), False where the
        kernel does not know the module (the unfused path runs)."""
        rotary = self.rotary_emb
        if type(rotary) is RotaryEmbedding:
            return rotary.cos_sin_cache if rotary.rot_dim == self.rope else False
        return None if getattr(rotary, "is_identity", False) else False

    def select(self, hidden: torch.Tensor, q_resid: torch.Tensor | None,
               positions: torch.Tensor, md: Any) -> Any:
        """The cached rows each query reads: all it may see (DeepSeek-V3.2 overrides)."""
        return None


class DeepseekMLP(nn.Module):
    """The dense SwiGLU MLP (first layers) and the shared experts; reduce_results=False leaves
    the tensor-parallel all-reduce to the caller."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 use_triton_ops: bool = True, reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], params_dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size,
                                           reduce_results=reduce_results, params_dtype=dtype)
        self.act = SiluAndMul(use_triton_ops=use_triton_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        self.gate = DeepseekRouter(cfg, use_triton_ops=use_triton_ops)
        self.experts = FusedMoE(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                reduce_results=False, params_dtype=dtype,
                                use_triton_ops=use_triton_ops)
        shared = getattr(cfg, "n_shared_experts", None) or 0
        self.shared_experts = (
            DeepseekMLP(cfg.hidden_size, cfg.moe_intermediate_size * shared, dtype,
                        use_triton_ops, reduce_results=False) if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        # the shared experts join the routed sum in FusedMoE (inside the bf16 decode
        # kernels' launches at decode sizes); their weights are read here, at each step
        shared = (None if self.shared_experts is None
                  else shared_experts_of(self.shared_experts))
        return tp_all_reduce(self.experts(x, weights.to(x.dtype), ids, shared=shared))


def is_moe_layer(cfg: Any, layer_idx: int) -> bool:
    """transformers' rule: sparse from first_k_dense_replace on, every moe_layer_freq-th
    (V3.2: as its mlp_layer_types lists)."""
    kinds = getattr(cfg, "mlp_layer_types", None)
    if kinds is not None and layer_idx < len(kinds):  # (an MTP layer past them: the rule)
        return kinds[layer_idx] == "sparse"
    freq = getattr(cfg, "moe_layer_freq", None) or 1
    return (bool(getattr(cfg, "n_routed_experts", None))
            and layer_idx >= (getattr(cfg, "first_k_dense_replace", None) or 0)
            and layer_idx % freq == 0)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's forward (pre-norm, fused residual adds); attention and MLP differ."""

    attention_cls: ClassVar[type[DeepseekMLA]] = DeepseekMLA

    def __init__(self, cfg: Any, dtype: torch.dtype, layer_idx: int,
                 use_triton_ops: bool = True):
        nn.Module.__init__(self)
        ops = use_triton_ops
        self.self_attn = self.attention_cls(cfg, dtype, ops)
        self.mlp = (DeepseekMoE(cfg, dtype, ops) if is_moe_layer(cfg, layer_idx)
                    else DeepseekMLP(cfg.hidden_size, cfg.intermediate_size, dtype, ops))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class DeepseekModel(LlamaModel):
    layer_cls: ClassVar[type[DeepseekDecoderLayer]] = DeepseekDecoderLayer

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build its own layers
        self.build_stages(
            cfg, dtype, lambda i: self.layer_cls(cfg, dtype, i, use_triton_ops),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops))


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    # q_proj is not fused with anything here; only the MLPs' gate/up are.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return DeepseekModel(hf_config, dtype, use_triton_ops)

    def attention_layers(self) -> list[LatentAttention]:  # type: ignore[override]
        return [layer.self_attn.attn for layer in self.model.layers
                if not isinstance(layer, PPMissingLayer)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        rest = super().load_weights(load_expert_tensors(
            self.stage_tensors(self._prepared(weights)), dict(self.named_parameters()),
            loaded, type(self).__name__))
        return loaded | rest

    def _prepared(self, weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
        """Drops the MTP layers and turns interleaved rotary rows into halves."""
        cfg = self.config
        n_layers, skipped = cfg.num_hidden_layers, 0
        interleaved = rope_is_interleaved(cfg)
        nope, rope, lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        for name, tensor in weights:
            m = _LAYER.match(name)
            if m and int(m[1]) >= n_layers:
                skipped += 1
                continue
            if interleaved and re.search(r"\.self_attn\.(q_proj|q_b_proj)\.weight$", name):
                tensor = deinterleave_rows(tensor, nope, rope, nope + rope)
            elif interleaved and re.search(r"\.self_attn\.kv_a_proj_with_mqa\.(weight|bias)$",
                                           name):
                tensor = deinterleave_rows(tensor, lora, rope, tensor.shape[0])
            yield name, tensor
        if skipped:
            logger.info("skipped %d tensors of multi-token-prediction layers", skipped)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass

"""Kimi Linear (moonshotai/Kimi-Linear-48B-A3B): Kimi Delta Attention layers
(shoal/layers/kimi_delta_attention.py) beside multi-head latent attention layers, as
config.layer_types lists them (transformers builds it from the checkpoint's 1-based
linear_attn_config.kda_layers / full_attn_layers), with DeepSeek-V3 MLPs: a dense SwiGLU
MLP, or from first_k_dense_replace on (config.mlp_layer_types "sparse") sigmoid-routed
experts with the score-correction bias, grouped top-k, renormalisation, routed_scaling_factor
and a shared expert.

The latent attention is DeepSeek's (shoal/models/deepseek_v2.py) without rotary embedding
(NoPE): the qk_rope_head_dim part of each key is still the one shared latent column, only
never rotated, so the checkpoint's rows need no de-interleaving either. Its cache row (one
plane, kv_lora_rank + qk_rope_head_dim per token) is the page that holds a KDA layer's state.

Checkpoint names: the MLPs live under block_sparse_moe (experts.E.w1/w3/w2 = gate/up/down),
the KDA projections, convs and decay parameters directly under self_attn (transformers' own
in-memory names, forget_gate.* and the concatenated conv1d, load too)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.core.kv_cache_spec import state_block_size
from shoal.layers.kimi_delta_attention import KimiDeltaAttention
from shoal.layers.linear import load_tensor
from shoal.layers.norm import RMSNorm
from shoal.models.deepseek_v2 import DeepseekMLA, DeepseekMLP, DeepseekMoE
from shoal.models.qwen3_next import HybridLayer, HybridModel, Qwen3NextForCausalLM

_LAYER = re.compile(r"^(model\.layers\.(\d+)\.self_attn\.)(.+)$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.weight$")
_EXPERT_PROJ = {"1": "gate", "2": "down", "3": "up"}


class _Overlay:
    """cfg with some attributes replaced (the names DeepSeek's modules read)."""

    def __init__(self, cfg: Any, **values: Any):
        self._cfg = cfg
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def deepseek_view(cfg: Any) -> _Overlay:
    """The Kimi config under DeepSeek-V3's names. DeepseekMLA builds a rotary table that
    KimiMLA drops: max position 1 keeps it one row instead of model_max_length (1M)."""
    return _Overlay(cfg, n_routed_experts=cfg.num_local_experts, scoring_func="sigmoid",
                    topk_method="noaux_tc", max_position_embeddings=1, rope_parameters=None,
                    rope_scaling=None, rope_theta=10000.0)


class _NoRope(nn.Module):
    is_identity = True  # (DeepseekMLA's fused input kernel then copies the rotary parts)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class KimiMLA(DeepseekMLA):
    """DeepSeek's latent attention, its shared key column left unrotated (NoPE)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__(deepseek_view(cfg), dtype, use_triton_ops)
        self.rotary_emb = _NoRope()


class KimiDecoderLayer(HybridLayer):
    def __init__(self, cfg: Any, dtype: torch.dtype, layer: int, use_triton_ops: bool):
        super().__init__()
        self.linear = cfg.layer_types[layer] == "linear_attention"
        self.self_attn: nn.Module = (KimiDeltaAttention(cfg, dtype) if self.linear
                                     else KimiMLA(cfg, dtype, use_triton_ops))
        sparse = cfg.mlp_layer_types[layer] == "sparse"
        self.mlp = (DeepseekMoE(deepseek_view(cfg), dtype, use_triton_ops) if sparse
                    else DeepseekMLP(cfg.hidden_size, cfg.intermediate_size, dtype,
                                     use_triton_ops))
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype, use_triton_ops)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, use_triton_ops)

    @property
    def mixer(self) -> nn.Module:  # (KDA and MLA alike under self_attn in the checkpoint)
        return self.self_attn


class KimiModel(HybridModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, layers: list[KimiDecoderLayer],
                 use_triton_ops: bool):
        super().__init__(cfg, dtype, layers, use_triton_ops)  # type: ignore[arg-type]
        # Kimi's final norm stores its weight, not weight - 1 as Qwen3-Next's
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops)


class KimiLinearForCausalLM(Qwen3NextForCausalLM):
    """Qwen3-Next's hybrid plumbing (paged layers in order, load path through the experts)
    around Kimi's layers."""

    # MLA's q_proj must not be fused (LlamaForCausalLM's q/k/v mapping); KDA's q/k/v are
    # routed before (_kda_tensors).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    skipped_prefixes: ClassVar[tuple[str, ...]] = ()

    def _build_model(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool) -> nn.Module:
        layers = [KimiDecoderLayer(cfg, dtype, i, use_triton_ops)
                  for i in range(cfg.num_hidden_layers)]
        return KimiModel(cfg, dtype, layers, use_triton_ops)

    @staticmethod
    def block_size_for(cfg: Any, dtype_bytes: int, tp: int) -> int:
        """The smallest block size whose latent page (one row of kv_lora_rank +
        qk_rope_head_dim per token, replicated across ranks) holds a KDA layer's state on
        this rank (float32 words: the conv's last K-1 inputs of q | k | v, and H x D x D)."""
        heads, d = cfg.linear_num_heads // tp, cfg.linear_head_dim
        words = 3 * heads * d * (cfg.linear_conv_kernel_dim - 1) + heads * d * d
        row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
        return state_block_size(4 * words, row)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        rest = super().load_weights(self._kda_tensors(self._renamed(weights), loaded))
        return loaded | rest

    @staticmethod
    def _renamed(weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names -> the ones load_expert_tensors and our modules take."""
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            name = name.replace(".self_attn.forget_gate.", ".self_attn.")
            name = _EXPERT.sub(lambda m: f".experts.{m[1]}.{_EXPERT_PROJ[m[2]]}_proj.weight",
                               name)
            yield name, tensor

    def _kda_tensors(self, weights: Iterable[tuple[str, torch.Tensor]],
                     loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Loads the KDA tensors that land in a fused parameter; yields the others."""
        params = dict(self.named_parameters())
        layers = self.model.layers
        for name, tensor in weights:
            m = _LAYER.match(name)
            i = int(m[2]) if m else len(layers)
            route = (KimiDeltaAttention.checkpoint_shards.get(m[3])
                     if i < len(layers) and layers[i].linear else None)
            if route is None:
                yield name, tensor
                continue
            target = m[1] + route[0]
            load_tensor(params[target], tensor, route[1])
            loaded.add(target)

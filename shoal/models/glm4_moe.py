"""GLM-4.5 / GLM-4.6 MoE (Glm4MoeForCausalLM): the Llama block (pre-norms, one norm before
attention and one before the MLP) with GLM-4's attention and DeepSeek-V3's mixture of experts.

Attention (shoal/models/glm4.py's Glm4Attention): q/k/v with a bias (attention_bias), o_proj
without; a partial rotary over the first head_dim * partial_rotary_factor features, rotating
halves (unlike GLM-4's interleaved pairs); optional RMSNorm on each query and key head
(use_qk_norm). head_dim may differ from hidden_size / num_attention_heads.

MoE (shoal/models/deepseek_v2.py's DeepseekMoE and DeepseekRouter, version 3): sigmoid scores;
the choice adds e_score_correction_bias, keeps the topk_group of n_group groups whose two best
biased scores sum highest and takes top-k among their experts; the weights are the unbiased
scores of the chosen experts, renormalized when norm_topk_prob, times routed_scaling_factor.
n_shared_experts always-on experts join the sum. The first first_k_dense_replace layers keep a
dense SwiGLU MLP. The multi-token-prediction layers of the checkpoints
(model.layers.{num_hidden_layers}...) are skipped on load. Built per pipeline stage
(LlamaModel.build_stages)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.layers.moe.deepseek_router import DeepseekRouter
from shoal.layers.moe.layer import FusedMoE
from shoal.layers.norm import RMSNorm
from shoal.models.deepseek_v2 import DeepseekMLP, DeepseekMoE, is_moe_layer
from shoal.models.expert_weights import load_expert_tensors
from shoal.models.glm4 import Glm4Attention
from shoal.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from shoal.models.olmo2 import check_silu

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeSparseBlock(DeepseekMoE):
    """DeepseekMoE's forward (routed experts + shared experts, one all-reduce); the router is
    V3's whatever the config's model_type says."""

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # DeepseekMoE's would infer the router version from the config
        self.gate = DeepseekRouter(cfg, version=3, use_triton_ops=use_triton_ops)
        self.experts = FusedMoE(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                reduce_results=False, params_dtype=dtype,
                                use_triton_ops=use_triton_ops)
        shared = getattr(cfg, "n_shared_experts", None) or 0
        self.shared_experts = (
            DeepseekMLP(cfg.hidden_size, cfg.moe_intermediate_size * shared, dtype,
                        use_triton_ops, reduce_results=False) if shared else None)


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's forward; the attention and the MLP differ."""

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True, *,
                 layer: int):
        nn.Module.__init__(self)  # not Llama's: it would build its attention and a dense MLP
        ops = use_triton_ops
        self.self_attn = Glm4Attention(cfg, dtype, ops, layer=layer,
                                       qk_norm=bool(getattr(cfg, "use_qk_norm", False)))
        self.mlp = (Glm4MoeSparseBlock(cfg, dtype, ops) if is_moe_layer(cfg, layer)
                    else LlamaMLP(cfg, dtype, ops))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class Glm4MoeModel(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build its own layers
        self.build_stages(
            cfg, dtype, lambda i: Glm4MoeDecoderLayer(cfg, dtype, use_triton_ops, layer=i),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops))


class Glm4MoeForCausalLM(LlamaForCausalLM):
    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        check_silu(hf_config, "GLM-4.5 MoE")
        return Glm4MoeModel(hf_config, dtype, use_triton_ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Expert tensors go into the stacked w13 / w2 parameters; the rest load as in Llama."""
        loaded: set[str] = set()
        rest = super().load_weights(load_expert_tensors(
            self.stage_tensors(self._without_mtp(weights)), dict(self.named_parameters()), loaded,
            type(self).__name__))
        return loaded | rest  # super() consumed the generator, which filled `loaded`

    def _without_mtp(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        n_layers, skipped = self.config.num_hidden_layers, 0
        for name, tensor in weights:
            m = _LAYER.match(name)
            if m and int(m[1]) >= n_layers:
                skipped += 1
                continue
            yield name, tensor
        if skipped:
            logger.info("skipped %d tensors of multi-token-prediction layers", skipped)

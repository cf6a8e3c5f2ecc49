"""IBM GraniteMoe (Granite 3.x MoE: 1B-A400M, 3B-A800M): Granite's layer (shoal/models/
granite.py: the embedding, residual and attention multipliers, logits_scaling) with every MLP
a sparse mixture of experts routed as Mixtral's (the softmax over the top-k logits equals the
renormalized top-k of the softmax over all).

Checkpoints keep each layer's experts stacked under `block_sparse_moe`: input_linear [E, 2I, H]
(gate rows, then up rows), output_linear [E, H, I] and router.layer [E, H]; transformers 5
names them experts.gate_up_proj, experts.down_proj and router. Both load into FusedMoE's
stacked parameters. The block keeps its checkpoint name, block_sparse_moe, so that LoRA
adapters of its experts (PEFT's target_parameters over block_sparse_moe.experts.gate_up_proj
and down_proj) name shoal's layer; its router is `gate` as in Mixtral. No sliding window
(transformers builds GraniteMoe's mask without one). Built per pipeline stage as Granite."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.models.expert_weights import load_expert_tensors
from shoal.models.granite import GraniteDecoderLayer, GraniteForCausalLM, GraniteModel
from shoal.models.mixtral import MixtralSparseBlock

# checkpoint (and transformers 5) names under a layer's block -> load_expert_tensors' names
# (which read experts under `.mlp.`) and the router's parameter
_RENAMES = (
    (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
    (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.gate.weight"),
    (".block_sparse_moe.router.weight", ".block_sparse_moe.gate.weight"),
    (".block_sparse_moe.experts.", ".mlp.experts."),
)
_BLOCK, _EXPERTS_AS_READ = ".block_sparse_moe.", ".mlp."


def checkpoint_to_expert_names(weights: Iterable[tuple[str, torch.Tensor]]
                               ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for src, dst in _RENAMES:
            if src in name:
                name = name.replace(src, dst)
                break
        yield name, tensor


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    def add_feed_forward(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool) -> None:
        self.block_sparse_moe = MixtralSparseBlock(cfg, dtype, use_triton_ops)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x)


class GraniteMoeModel(GraniteModel):
    layer_cls = GraniteMoeDecoderLayer


class GraniteMoeForCausalLM(GraniteForCausalLM):
    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return GraniteMoeModel(hf_config, dtype, use_triton_ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Expert tensors (either layout) go into the stacked w13 / w2 parameters; the rest
        load as in Llama."""
        loaded: set[str] = set()
        params = {name.replace(_BLOCK, _EXPERTS_AS_READ): p
                  for name, p in self.named_parameters()}
        rest = super().load_weights(load_expert_tensors(
            checkpoint_to_expert_names(self.stage_tensors(weights)), params, loaded,
            type(self).__name__))
        # (super() consumed the generator, which filled `loaded`)
        return {name.replace(_EXPERTS_AS_READ, _BLOCK) for name in loaded} | rest

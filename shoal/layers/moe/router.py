"""Softmax top-k routing, as Hugging Face Qwen3-MoE / Mixtral-style routers compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.linear import default_weight_loader


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (weights [T, k] in the logits' dtype, expert ids int64 [T, k]).

    Softmax in float32 over all experts, then top-k, then (optionally) rescale the k weights to
    sum to one; the weights are rounded to the activation dtype only at the end, as in
    transformers, so bf16 routing matches it bit for bit."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class TopKRouter(nn.Module):
    """The gate: a [E, H] projection replicated on every tensor-parallel rank, so each rank
    routes its (identical) hidden states itself and no routing decision is communicated."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(F.linear(x, self.weight), self.top_k, self.renormalize)

"""Softmax top-k routing, as Hugging Face Qwen3-MoE / Mixtral-style routers compute it (and
GPT-OSS's top-k-then-softmax). CUDA logits go through one Triton launch
(shoal/layers/moe/topk_routing.py); at decode sizes the routers' gate GEMV and routing go
through one launch together (gate_routing.py); other tensors keep the torch code below."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal import envs
from shoal.layers.linear import default_weight_loader
from shoal.layers.ops.dispatch import use_triton


def routes_on_kernel(logits: torch.Tensor, top_k: int, enabled: bool = True) -> bool:
    """CUDA logits of a shape the routing kernel takes, kernels enabled (the model's
    use_triton_ops); else the torch code runs: no error here, it raises on what it cannot
    do."""
    if not use_triton(logits, enabled):
        return False
    from shoal.layers.moe.topk_routing import fits_kernel

    return fits_kernel(logits, top_k)


def routes_fused(x: torch.Tensor, weight: torch.Tensor, top_k: int, enabled: bool = True,
                 bias: torch.Tensor | None = None) -> bool:
    """CUDA activations of a decode-sized step the fused gate-and-routing launch takes
    (gate_routing.fits_fused), kernels enabled; else F.linear and the routing run apart."""
    if not use_triton(x, enabled) or not envs.SHOAL_FUSED_GATE_ROUTING.get():
        return False
    from shoal.layers.moe.gate_routing import fits_fused, scratch_ready

    # (a graph captured before any eager call, e.g. a drafter's, keeps the two launches)
    return fits_fused(x, weight, top_k, bias) and scratch_ready(x.device, weight.shape[0])


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   use_triton_ops: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (weights [T, k] in the logits' dtype, expert ids int64 [T, k]).

    Softmax in float32 over all experts, then top-k, then (optionally) rescale the k weights to
    sum to one; the weights are rounded to the activation dtype only at the end, as in
    transformers, so bf16 routing matches it bit for bit (on CUDA the kernel's float32
    weights are within a couple of ulps of these before that rounding)."""
    if routes_on_kernel(router_logits, top_k, use_triton_ops):
        from shoal.layers.moe.topk_routing import topk_routing

        return topk_routing(router_logits, top_k, "softmax_then_topk", renormalize)
    return select_experts_torch(router_logits, top_k, renormalize)


def select_experts_torch(router_logits: torch.Tensor, top_k: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts in torch ops (the CPU path and the kernel's reference)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def topk_then_softmax(router_logits: torch.Tensor, top_k: int,
                      use_triton_ops: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's routing: the top k logits, softmaxed among themselves in the logits' dtype
    (float32 inside, one rounding) -> (weights [T, k], expert ids int64 [T, k])."""
    if routes_on_kernel(router_logits, top_k, use_triton_ops):
        from shoal.layers.moe.topk_routing import topk_routing

        return topk_routing(router_logits, top_k, "topk_then_softmax")
    return topk_then_softmax_torch(router_logits, top_k)


def topk_then_softmax_torch(router_logits: torch.Tensor,
                            top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_then_softmax in torch ops (the CPU path and the kernel's reference)."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


class TopKRouter(nn.Module):
    """The gate: a [E, H] projection replicated on every tensor-parallel rank, so each rank
    routes its (identical) hidden states itself and no routing decision is communicated."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 params_dtype: torch.dtype | None = None, use_triton_ops: bool = True):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.renormalize = top_k, renormalize
        self.use_triton_ops = use_triton_ops
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if routes_fused(x, self.weight, self.top_k, self.use_triton_ops):
            from shoal.layers.moe.gate_routing import gate_routing

            return gate_routing(x, self.weight, self.top_k, "softmax_then_topk",
                                self.renormalize)
        return select_experts(F.linear(x, self.weight), self.top_k, self.renormalize,
                              self.use_triton_ops)

"""The routed expert MLPs in plain PyTorch: the CPU path and the reference for the Triton
kernel. Each expert is SiLU(x W_gate^T) * (x W_up^T) projected by W_down (another activation
and per-expert biases where the layer has them, activation.py), scaled by the token's routing
weight; a token's output is the sum over its k experts. `lora`: FusedMoE's LoRA hook
(layer.py), called after each projection."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shoal.layers.moe.activation import SILU, ExpertActivation


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: ExpertActivation,
                b13: torch.Tensor | None, b2: torch.Tensor | None, lora: Any = None,
                e: int = 0, tokens: torch.Tensor | None = None) -> torch.Tensor:
    if lora is None:
        return F.linear(act(F.linear(x, w13, b13)), w2, b2)
    gate_up = F.linear(x, w13, b13)
    lora.add("w13", gate_up, x, e, tokens)
    h = act(gate_up)
    out = F.linear(h, w2, b2)
    lora.add("w2", out, h, e, tokens)
    return out


def _row(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias is None else bias[e]


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: ExpertActivation = SILU, lora: Any = None) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; topk_weights,
    topk_ids: [T, k]; optional biases w13_bias [E, 2I], w2_bias [E, H] (added before the
    routing weight scales the output). Runs each expert once on the tokens routed to it, in
    expert order like transformers (so fp32 sums round the same way). Pairs with id E (another rank's expert
    under expert parallelism; they sort last) are skipped. Reads the per-expert counts on the
    host: not for CUDA-graph capture (see experts_dense)."""
    t, k = topk_ids.shape
    num_experts = w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()[:num_experts]
    weights = topk_weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // k
        y = _expert_mlp(x[tokens], w13[e], w2[e], activation, _row(w13_bias, e),
                        _row(w2_bias, e), lora, e, tokens) * weights[pairs, None]
        out.index_add_(0, tokens, y)
    return out


def experts_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: ExpertActivation = SILU, lora: Any = None) -> torch.Tensor:
    """Every expert on every token, scaled by its routing weight (0 when not chosen). Shapes
    never depend on the routing and nothing is read back to the host, so a CUDA graph can
    capture it; E/k times the routed work, so it is only the fallback for capturing on CUDA
    without the Triton kernel (use_triton_ops=False)."""
    num_experts = w13.shape[0]
    dense = torch.zeros(x.shape[0], num_experts, dtype=topk_weights.dtype, device=x.device)
    dense.scatter_add_(1, topk_ids, topk_weights)
    out = torch.zeros_like(x)
    for e in range(num_experts):
        out += _expert_mlp(x, w13[e], w2[e], activation, _row(w13_bias, e),
                           _row(w2_bias, e), lora, e) * dense[:, e:e + 1]
    return out

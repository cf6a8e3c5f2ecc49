"""The routed expert MLPs in plain PyTorch: the CPU path and the reference for the Triton
kernel. Each expert is SiLU(x W_gate^T) * (x W_up^T) projected by W_down, scaled by the token's
routing weight; a token's output is the sum over its k experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; topk_weights,
    topk_ids: [T, k]. Runs each expert once on the tokens routed to it, in expert order like
    transformers (so fp32 sums round the same way). Pairs with id E (another rank's expert
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
        y = _expert_mlp(x[tokens], w13[e], w2[e]) * weights[pairs, None]
        out.index_add_(0, tokens, y)
    return out


def experts_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, scaled by its routing weight (0 when not chosen). Shapes
    never depend on the routing and nothing is read back to the host, so a CUDA graph can
    capture it; E/k times the routed work, so it is only the fallback for capturing on CUDA
    without the Triton kernel (use_triton_ops=False)."""
    num_experts = w13.shape[0]
    dense = torch.zeros(x.shape[0], num_experts, dtype=topk_weights.dtype, device=x.device)
    dense.scatter_add_(1, topk_ids, topk_weights)
    out = torch.zeros_like(x)
    for e in range(num_experts):
        out += _expert_mlp(x, w13[e], w2[e]) * dense[:, e:e + 1]
    return out

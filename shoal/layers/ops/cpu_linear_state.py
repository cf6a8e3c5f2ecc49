"""The decode step of a linear-attention layer on the CPU through shoal's C++ kernel
(shoal/csrc/linear_state_cpu.cpp, built and loaded by shoal/cpu_kernels.py): one call per
layer and step runs the short conv with its state, the q/k L2 norms and the gated delta rule,
reading and writing each request's states in place in their pages of the KV pool.

It replaces LinearAttention's torch decode path (a gather of the states, a dozen ops over them,
a scatter back), which took a quarter (batch 1) to a half (batch 8) of a bf16 CPU decode step
of a Qwen3.5-shaped model (benchmarks/hybrid_cpu_profile.py). Used for float32 and bfloat16 CPU activations whenever the C++ layer ops are
(SHOAL_CPU_LAYER_KERNELS=0 keeps the torch path)."""

from __future__ import annotations

import torch

from shoal import cpu_kernels
from shoal.attention.linear_state import StatePages


def usable(x: torch.Tensor) -> bool:
    return cpu_kernels.layer_ops_usable(x)


def decode_step(x: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                g: torch.Tensor, beta: torch.Tensor, pages: StatePages, read: torch.Tensor,
                write: torch.Tensor, scale: float, divide_norm: bool) -> torch.Tensor:
    """x [B, C] the conv input (q | k | v of Hk, Hk and H heads); g [B, H] or [B, H, Dk] log
    decay and beta [B, H] (float32). Each row's states move from block read[b] to write[b].
    divide_norm: q and k normed as x / sqrt(sum x^2 + eps) (KDA) instead of x * rsqrt(...).
    Returns o [B, H, Dv] float32."""
    heads, dk, dv = pages.state_shape
    o = torch.empty(x.shape[0], heads, dv, dtype=torch.float32)
    torch.ops.shoal_cpu.linear_state_decode(
        pages.words, o, x, conv_weight, conv_bias, g.float().contiguous(),
        beta.float().contiguous(), read, write, dk, dv, scale, divide_norm)
    return o

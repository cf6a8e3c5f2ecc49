"""The decoder layer's small ops on the CPU through shoal's C++ kernels (shoal/csrc/
layer_ops_cpu.cpp, built and loaded by shoal/cpu_kernels.py): RMSNorm with the residual add
fused, SiLU(gate) * up and the neox rotary embedding in place (the KV cache write, from the
same library, is shoal/attention/ops/cpu_kv_cache_write.py).

Each replaces a chain of torch ops that makes a full pass and an allocation per op (a bf16
RMSNorm is seven of them); a layer uses them for float32 and bfloat16 CPU tensors when the
extension is built. SHOAL_CPU_LAYER_KERNELS=0 keeps the torch paths (A/B runs)."""

from __future__ import annotations

import torch

from shoal import cpu_kernels

usable = cpu_kernels.layer_ops_usable  # whether x's op may run here


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight, x [T, H] or [T, heads, D] with a contiguous last dim."""
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.shoal_cpu.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- RMSNorm(residual) * weight; returns both."""
    torch.ops.shoal_cpu.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> SiLU(gate) * up [T, I]."""
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    torch.ops.shoal_cpu.silu_and_mul(out, x)
    return out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, rot_dim: int) -> None:
    """Rotates the first rot_dim dims of q [T, Hq, D] and k [T, Hk, D] in place."""
    torch.ops.shoal_cpu.rotary_embedding(positions, q, k, cos_sin_cache, rot_dim)

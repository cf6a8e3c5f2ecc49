"""RMSNorm with the residual add fused into the same call (one pass on the GPU's Triton kernel
and the CPU's C++ one)."""

from __future__ import annotations

import torch
from torch import nn

from shoal.layers.ops import cpu_layer_ops
from shoal.layers.ops.dispatch import use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None,
                 use_triton_ops: bool = True):
        super().__init__()
        self.eps = eps
        self.use_triton_ops = use_triton_ops  # the Triton kernel for CUDA tensors
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        orig = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(orig) * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton(x, self.use_triton_ops):
            from shoal.layers.ops.rms_norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if self._cpu_kernel_fits(x, residual):
            if residual is None:
                return cpu_layer_ops.rms_norm(x, self.weight, self.eps)
            return cpu_layer_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return self.forward_native(x, residual)

    def _cpu_kernel_fits(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (x.dim() in (2, 3) and x.stride(-1) == 1 and self.weight.dtype == x.dtype
                and cpu_layer_ops.usable(x)
                and (residual is None or (residual.shape == x.shape
                                          and residual.dtype == x.dtype
                                          and residual.stride(-1) == 1)))

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The PyTorch path: the reference the fused kernel is tested against."""
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint stores weight - 1 (Qwen3-Next, Qwen3.5: x_normed * (1 + w));
    the loader adds the 1, so the norm runs as a plain RMSNorm (and through its kernels)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 params_dtype: torch.dtype | None = None, use_triton_ops: bool = True):
        super().__init__(hidden_size, eps, params_dtype, use_triton_ops)
        self.weight.weight_loader = _load_plus_one


def _load_plus_one(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded.float() + 1.0)

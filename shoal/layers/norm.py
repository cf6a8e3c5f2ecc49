"""RMSNorm with the residual add fused into the same call (one pass on the GPU's Triton kernel
and the CPU's C++ one); a LayerNorm that takes the residual the same way (StarCoder2, Cohere);
and an RMSNorm over a projection split across tensor-parallel ranks (OLMo 2's q/k norms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.distributed.parallel_state import get_tp_rank, get_tp_world_size, tp_all_reduce
from shoal.layers.linear import default_weight_loader
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


class ResidualLayerNorm(nn.LayerNorm):
    """LayerNorm (with or without a bias) that takes the residual as RMSNorm does:
    norm(x, residual) -> (norm(x + residual), x + residual). Computed in float32, as
    transformers' StarCoder2 and Cohere norms (and nn.LayerNorm on the CPU) do."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, bias: bool = True):
        super().__init__(hidden_size, eps=eps, bias=bias, dtype=dtype)
        self.requires_grad_(False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), bias,
                            self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a projection whose features are split over the tensor-parallel ranks:
    this rank holds `local` of the `full` features (its heads' slice of the weight), and
    `replicas` ranks hold each slice (KV heads replicated when fewer than ranks)."""

    def __init__(self, full: int, local: int, eps: float, dtype: torch.dtype,
                 replicas: int = 1):
        super().__init__()
        self.full, self.eps, self.replicas = full, eps, replicas
        self.tp = get_tp_world_size()
        self.slot = get_tp_rank() // replicas
        self.weight = nn.Parameter(torch.ones(local, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.slot * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sq = xf.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            sq = tp_all_reduce(sq) / self.replicas
        # transformers multiplies by the weight in float32, then rounds
        return (xf * torch.rsqrt(sq / self.full + self.eps) * self.weight.float()).to(x.dtype)

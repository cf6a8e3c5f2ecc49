"""SiLU(gate) * up on a fused gate_up projection output; o * sigmoid(gate) on gated
attention's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.ops import cpu_layer_ops
from shoal.layers.ops.dispatch import use_triton

HALF_OR_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


class SiluAndMul(nn.Module):
    def __init__(self, use_triton_ops: bool = True):
        super().__init__()
        self.use_triton_ops = use_triton_ops  # the Triton kernel for 2-D CUDA tensors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x, self.use_triton_ops) and x.dim() == 2:
            from shoal.layers.ops.silu_mul import silu_and_mul

            return silu_and_mul(x)
        if x.dim() == 2 and x.stride(-1) == 1 and cpu_layer_ops.usable(x):
            return cpu_layer_ops.silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, use_triton_ops: bool = True
                 ) -> torch.Tensor:
    """o * sigmoid(gate) -> [T, H * D], from o and gate [T, H, D] (gate may be a strided view
    of the q projection's output): one Triton launch for CUDA tensors of the shapes and
    dtypes it takes (ops/sigmoid_gate.py), else torch's three ops."""
    t, d = o.shape[0], gate.shape[-1]
    if (use_triton(o, use_triton_ops) and gate.stride(-1) == 1 and d & (d - 1) == 0
            and gate.dim() == 3 and o.dtype == gate.dtype and o.dtype in HALF_OR_FLOAT):
        from shoal.layers.ops.sigmoid_gate import sigmoid_gate as fused

        return fused(o.reshape(gate.shape), gate)
    return o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))

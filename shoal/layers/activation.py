"""SiLU(gate) * up on a fused gate_up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.fused_ops import use_triton


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x) and x.dim() == 2:
            from shoal.attention.ops.silu_mul import silu_and_mul

            return silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

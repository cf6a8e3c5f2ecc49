"""y = x W^T (+ b) for the few rows of a small decode step on the CPU, through shoal's C++
kernel (shoal/csrc/small_linear_cpu.cpp): each weight row is read once for all rows of x at
close to the memory's speed, where torch's CPU matmul reads it at a third of that (float32
on a Zen 3 host: 20-27 against 7-14 GB/s for one row, 13-17 against 5-6 for four, 8-11
against 5-7 for eight).

Any other device, dtype, layout or a larger step takes F.linear. SHOAL_CPU_LAYER_KERNELS=0
turns it off with the other C++ layer ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.layers.ops import cpu_layer_ops

MAX_ROWS = 8  # the kernel's limit; still 1.4-2.4x torch's speed at 8 rows (above)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    if (x.is_cpu and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2
            and weight.dtype == x.dtype and weight.is_contiguous()
            and (bias is None or bias.dtype == x.dtype) and cpu_layer_ops.usable(x)):
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
        torch.ops.shoal_cpu.small_linear(out, x, weight, bias)
        return out
    return F.linear(x, weight, bias)

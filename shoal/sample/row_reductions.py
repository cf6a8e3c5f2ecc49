"""Per-row reductions of the logits that every step runs: the greedy token and whether a row
is all finite. On the CPU they go through shoal's C++ kernels (shoal/csrc/sampling_cpu.cpp:
0.4 and 0.1 ms at batch 64 x 49,152 bf16 against 5.5 and 4.8 ms for torch's argmax and
isfinite().all() on 2 cores); elsewhere, or without the kernels, through torch."""

from __future__ import annotations

import torch

from shoal.layers.ops import cpu_layer_ops


def _cpu_kernel_fits(logits: torch.Tensor) -> bool:
    return logits.dim() == 2 and logits.stride(-1) == 1 and cpu_layer_ops.usable(logits)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) (int64 [rows]); ties go to the first index, as in torch."""
    if not _cpu_kernel_fits(logits):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.long)
    torch.ops.shoal_cpu.argmax_rows(out, logits)
    return out


def rows_finite(logits: torch.Tensor) -> torch.Tensor:
    """torch.isfinite(logits).all(dim=-1) (bool [rows])."""
    if not _cpu_kernel_fits(logits):
        return torch.isfinite(logits).all(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.bool)
    torch.ops.shoal_cpu.rows_finite(out, logits)
    return out

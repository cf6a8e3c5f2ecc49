"""A decode GEMV's K cut among programs of whole steps, and what its strip's-last-program sum
needs (int4_wide_gemv.py, int4_mma_gemv.py): float32 partials [split, M, N] and a counter a
strip (program_counters.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from shoal.layers.ops.program_counters import counters


@dataclass(frozen=True)
class KSplit:
    span: int  # inputs a program covers (whole steps)
    split: int  # programs a strip: the ones left with inputs
    strips: int  # programs along N
    out: torch.Tensor  # [M, N] in x's dtype
    part: torch.Tensor  # float32 partials [split, M, N] (out when split is 1)
    count: torch.Tensor  # the strips' counters (out when split is 1)


def k_split(x: torch.Tensor, n: int, k: int, step: int, split: int, block_n: int,
            who: str) -> KSplit:
    """x [M, K]: `split` programs a strip asked for, steps of `step` inputs, strips of
    `block_n` outputs; `who` names the kernel where counters cannot be made (a capture)."""
    m = x.shape[0]
    span = triton.cdiv(triton.cdiv(k, step), split) * step
    split = triton.cdiv(k, span)
    strips = triton.cdiv(n, block_n)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 \
        else out
    count = counters(x.device, strips, who) if split > 1 else out
    return KSplit(span, split, strips, out, part, count)

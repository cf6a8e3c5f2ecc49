"""Rounding float32 to the LoRA op's dtype inside its Triton kernels, as the GPU rounds.

A GPU rounds float32 -> bfloat16 to nearest even; Triton's CPU interpreter (the tests' way
of running the kernels without a GPU) truncates. With INTERPRETED set, the bits are rounded
to nearest even first, so the truncation is exact and the interpreter's results are the
GPU's (finite values; the interpreter is a test device)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """v (float32) rounded to dtype (to nearest even)."""
    if INTERPRETED:
        if dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)

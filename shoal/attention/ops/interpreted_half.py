"""Half-dtype steps of a Triton kernel that give the GPU's results under TRITON_INTERPRET=1 too.

Triton's CPU interpreter (3.9), the tests' way of running kernels without a GPU, gets two
bfloat16 steps wrong: tl.dot of bf16 tiles returns garbage (off by ~1e10), and a float32 ->
bf16 conversion truncates where the GPU rounds to nearest even. With INTERPRETED set these
helpers widen a dot's half operands to float32 (a product of two half values is exact in
float32, so only the order of the sums differs from a tensor core's), and round a conversion's
bits to nearest even before the interpreter truncates them. On the GPU (INTERPRETED False)
they are the plain tl.dot and .to."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def half_dot(a, b, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """tl.dot(a, b) in float32 sums, a and b of any one dtype (half ones on tensor cores)."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def to_dtype(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """v converted to dtype, a float32 -> bfloat16 one rounded to nearest even."""
    if INTERPRETED:
        if v.dtype == tl.float32 and dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)

"""SiLU(gate) * up on a fused gate_up projection output [T, 2I] -> [T, I].

Rounding follows shoal.layers.activation.SiluAndMul: silu(gate) is rounded to the activation
dtype before the multiply."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal import pdl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl.grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs,
             (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] (gate then up) -> [T, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2I], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {x.dtype}")
    n, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    elif out.shape != (n, inter) or out.dtype != x.dtype:
        raise ValueError(f"out must be {x.dtype} [{n}, {inter}]")
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("rows must be contiguous")
    if n == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
        **pdl.kwargs(x.device))
    return out

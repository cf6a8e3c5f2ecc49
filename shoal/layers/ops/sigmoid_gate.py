"""o * sigmoid(gate) on gated attention's output (Qwen3-Next, Qwen3.5): one launch reading
the gate where the q projection left it, a strided [T, H, D] view beside each head's query,
where torch takes three (the gate's copy, sigmoid, the multiply).

Rounding follows torch in the activation dtype: sigmoid(gate) is rounded to it before the
multiply, the product once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal import pdl


@triton.jit
def _sigmoid_gate_kernel(o_ptr, g_ptr, out_ptr, stride_ot, stride_oh, stride_gt, stride_gh,
                         heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl.grid_dependency(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < heads
    g = tl.load(g_ptr + t * stride_gt + h * stride_gh + d, mask=mask, other=0.0)
    o = tl.load(o_ptr + t * stride_ot + h * stride_oh + d, mask=mask, other=0.0)
    s = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + t * heads * HEAD_DIM + h * HEAD_DIM + d,
             (o.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o, gate: [T, H, D] of one dtype (any token and head strides, D contiguous and a power
    of two) -> o * sigmoid(gate) as a new contiguous [T, H * D]."""
    if o.dim() != 3 or gate.shape != o.shape or gate.dtype != o.dtype:
        raise ValueError(f"o {tuple(o.shape)} {o.dtype} and gate {tuple(gate.shape)} "
                         f"{gate.dtype} must be [T, H, D] of one dtype")
    t, h, d = o.shape
    if d & (d - 1) or o.stride(2) != 1 or gate.stride(2) != 1:
        raise ValueError(f"head dim {d} must be a contiguous power of two")
    if o.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {o.dtype}")
    out = torch.empty(t, h * d, dtype=o.dtype, device=o.device)
    if t == 0:
        return out
    block_h = min(triton.next_power_of_2(h), max(1, 2048 // d))  # ~2K values a program
    _sigmoid_gate_kernel[(t, triton.cdiv(h, block_h))](
        o, gate, out, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1), h,
        HEAD_DIM=d, BLOCK_H=block_h, num_warps=4, **pdl.kwargs(o.device))
    return out

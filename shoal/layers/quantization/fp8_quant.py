"""Activations to FP8 (e4m3) at run time: one scale per token (group = K, for the per-channel
weight path through torch._scaled_mm) or per token and group of `group` inputs (1 x 128, the
block-scaled weight path). scale = amax / 448, so each group's largest value lands on e4m3's
largest; q = x / scale rounded to nearest."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
MIN_SCALE = 1e-10  # an all-zero group still divides by something finite


@triton.jit
def round_to_e4m3(v):
    """v (float32, within +-448) rounded to nearest-even on e4m3's 3-bit mantissa grid, so the
    float8 cast that follows is exact. (The hardware cast rounds the same way; Triton's
    interpreter drops the carry of a mantissa that rounds up to the next power of two.)"""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # clear the low 20 bits, RNE
    normal = bits.to(tl.float32, bitcast=True)
    # below 2^-6 (subnormal e4m3) the grid is 2^-9: float32's own rounding of t + 1.5 * 2^23
    # to an integer rounds t = v * 2^9 to nearest-even
    t = v * 512.0
    sub = ((t + 12582912.0) - 12582912.0) / 512.0
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, GROUP,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * GROUP
    end = tl.minimum(start + GROUP, K)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(start, end, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_x + offs, mask=offs < end, other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-10)
    for c in range(start, end, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_x + offs, mask=offs < end, other=0.0)
        q = round_to_e4m3(tl.clamp(v.to(tl.float32) / scale, -448.0, 448.0))
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < end)
    tl.store(s_ptr + row * stride_s + g, scale)


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)])."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with contiguous rows (got {tuple(x.shape)})")
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block = min(triton.next_power_of_2(group), 1024)
    _group_quant_kernel[(m, groups)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), group,
                                     BLOCK=block, num_warps=4 if block <= 256 else 8)
    return q, s


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """With a checkpoint's fixed activation scale (a 0-d float32 tensor)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """quantize_fp8_groups in plain PyTorch (the tests' oracle)."""
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    s = (xf.abs().amax(-1) / E4M3_MAX).clamp_min(MIN_SCALE)
    q = (xf / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).view(m, -1)[:, :k]
    return q.to(torch.float8_e4m3fn), s

"""y = x W^T with 4-bit weights dequantized in registers (W4A16, the role Marlin plays in
vLLM). W is stored as int32 words [ceil(K / 8), N], code k of output n at bits 4 (k % 8) of
word [k // 8, n] (GPTQ's layout, loads contiguous along N); scales [G, N] and, asymmetric,
zero points uint8 [G, N]; w = scale * (code - zero), zero 8 when symmetric. Each K step lies
in one group (BLOCK_K divides the group, or one group spans K), so one row of scales and zeros
serves a whole step."""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from shoal.layers.quantization.tiles import Tiles, choose, k_per_split


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, K_SPLIT, GROUP,
                  stride_xm, stride_wk, stride_sg, stride_os, stride_om,
                  HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows_x = offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + rows_x + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        words = tl.load(w_ptr + (offs_k // 8).to(tl.int64)[:, None] * stride_wk
                        + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0)
        codes = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        g = (k0 // GROUP).to(tl.int64)
        scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0).to(tl.int32)
            w = (codes - zero[None, :]).to(tl.float32) * scale[None, :]
        else:
            w = (codes - 8).to(tl.float32) * scale[None, :]
        acc += tl.dot(x, w.to(x.dtype))
    out = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
    tl.store(out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def block_k_for(group: int, k: int) -> int:
    """The K step: the largest power of two <= 128 that divides the group (any, for one
    group over all of K)."""
    if group >= k:
        return 128 if k >= 128 else max(16, triton.next_power_of_2(k))
    step = 128
    while step > 16 and group % step:
        step //= 2
    if group % step:
        raise ValueError(f"int4 group size {group} is not a multiple of 16")
    return step


def w4a16_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) -> [M, N] in x's dtype. codes int32
    [ceil(K / 8), N]; scales [G, N] (any float dtype); zeros uint8 [G, N] or None (8)."""
    m, k = x.shape
    n = codes.shape[1]
    if codes.shape[0] != triton.cdiv(k, 8) or scales.shape[1] != n or x.stride(1) != 1:
        raise ValueError(f"w4a16_matmul: x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
                         f"scales {tuple(scales.shape)} do not fit")
    if zeros is not None and (zeros.shape != scales.shape or zeros.stride() != scales.stride()):
        raise ValueError("zeros must match scales in shape and strides")
    step = block_k_for(group, k)
    t = choose(m, n, k, step, x.device)
    span = k_per_split(k, step, t.split_k)
    split = triton.cdiv(k, span)
    out = torch.empty((split, m, n) if split > 1 else (m, n),
                      dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    if m == 0:
        return out if split == 1 else out.sum(0).to(x.dtype)
    t = _FITTED.get(t, t)
    while True:
        grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), split)
        try:
            _w4a16_kernel[grid](
                x, codes, scales, zeros if zeros is not None else scales, out, m, n, k, span,
                max(group, 1), x.stride(0), codes.stride(0), scales.stride(0), m * n, n,
                HAS_ZERO=zeros is not None, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=step,
                num_warps=t.num_warps, num_stages=t.num_stages)
            break
        except OutOfResources:  # (raised at the first launch of a config: before any capture)
            smaller = _smaller(t)
            if smaller is None:
                raise
            _FITTED[choose(m, n, k, step, x.device)] = t = smaller
    return out if split == 1 else out.sum(0).to(x.dtype)


# Tiles whose kernel needs more shared memory than the GPU has -> the tiles that fit there
# (the dequantized weight tile is staged in shared memory too: 128 x 128 tiles over 3 stages
# asked an H200 for 257 KB of its 227).
_FITTED: dict[Tiles, Tiles] = {}


def _smaller(t: Tiles) -> Tiles | None:
    """Fewer pipeline stages first, then half the rows, then half the columns."""
    if t.num_stages > 2:
        return replace(t, num_stages=t.num_stages - 1)
    if t.block_m > 16:
        return replace(t, block_m=t.block_m // 2, num_warps=max(4, t.num_warps // 2))
    if t.block_n > 32:
        return replace(t, block_n=t.block_n // 2)
    return None

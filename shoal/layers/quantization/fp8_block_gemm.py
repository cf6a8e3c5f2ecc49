"""y = x W^T with FP8 activations and weights and block scales, the DeepSeek-V3 / Qwen3-FP8
scheme: x quantized per token and group of G inputs (scales [M, K / G]), W per tile of
SCALE_ROWS x G (scales [N / SCALE_ROWS, K / G]; SCALE_ROWS 128 for a checkpoint's 128 x 128
tiles, 1 where a fused layer's parts do not align to them). Each K step is one group: its FP8
product accumulates in float32 times the two scales."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.layers.quantization.tiles import choose, k_per_split


@triton.jit
def _fp8_block_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, M, N, K, K_SPLIT,
                      stride_am, stride_asm, stride_bn, stride_bsn, stride_os, stride_om,
                      SCALE_ROWS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows_a = offs_m.to(tl.int64)[:, None] * stride_am
    rows_b = offs_n.to(tl.int64)[None, :] * stride_bn
    scale_rows = (offs_n // SCALE_ROWS).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + rows_a + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(b_ptr + rows_b + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        g = k0 // BLOCK_K
        a_s = tl.load(as_ptr + offs_m.to(tl.int64) * stride_asm + g, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + scale_rows + g, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    out = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
    tl.store(out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_matmul(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                     w_scale: torch.Tensor, group: int, scale_rows: int,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """a float8 [M, K], a_scale float32 [M, ceil(K / group)], w float8 [N, K], w_scale
    float32 [ceil(N / scale_rows), ceil(K / group)] -> [M, N] in out_dtype."""
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k or a.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"fp8_block_matmul: a {tuple(a.shape)} and w {tuple(w.shape)} need "
                         "the same K and contiguous rows")
    if group < 16 or group & (group - 1):
        raise ValueError(f"fp8 block group must be a power of two >= 16 (got {group})")
    t = choose(m, n, k, group, a.device)
    split = t.split_k
    span = k_per_split(k, group, split)
    split = triton.cdiv(k, span)
    out = torch.empty((split, m, n) if split > 1 else (m, n),
                      dtype=torch.float32 if split > 1 else out_dtype, device=a.device)
    if m == 0:
        return out if split == 1 else out.sum(0).to(out_dtype)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), split)
    _fp8_block_kernel[grid](
        a, a_scale, w, w_scale, out, m, n, k, span, a.stride(0), a_scale.stride(0),
        w.stride(0), w_scale.stride(0), m * n, n, scale_rows, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, BLOCK_K=group, num_warps=t.num_warps, num_stages=t.num_stages)
    return out if split == 1 else out.sum(0).to(out_dtype)

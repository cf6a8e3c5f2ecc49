"""Neox-style rotary embedding applied in place to q and k.

Each head's first rot_dim features are two halves (x1, x2) rotated as pairs:
x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, in fp32, with cos/sin read from the
cos_sin_cache row of the token's position ([max_pos, rot_dim]: cos half, then sin half)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, t, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + offs_h
        mask = (heads < num_heads)[:, None] & (offs_d < HALF)[None, :]
        p1 = x_ptr + t * stride_t + heads[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(p1, (f1 * cos - f2 * sin).to(x1.dtype), mask=mask)
        tl.store(p1 + HALF, (f2 * cos + f1 * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_c, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_d, mask=dmask,
                  other=0.0).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, num_q_heads, cos, sin,
                  HALF, BLOCK_HALF, BLOCK_HQ)
    _rotate_heads(k_ptr, stride_kt, stride_kh, t, num_k_heads, cos, sin,
                  HALF, BLOCK_HALF, BLOCK_HK)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int; q: [T, Hq, D]; k: [T, Hk, D] (strided views of a fused qkv output
    are fine); cos_sin_cache: [max_pos, rot_dim], rot_dim <= D even. Rotates q and k in place
    (features past rot_dim untouched) and returns them."""
    t, hq, d = q.shape
    if k.dim() != 3 or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [{t}]")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be [max_pos, rot_dim], contiguous rows")
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > d:
        raise ValueError(f"rot_dim {rot} must be even and <= head dim {d}")
    if q.dtype != k.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q {q.dtype} / k {k.dtype}: need one of fp16/bf16/fp32")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("the head dim must be contiguous")
    if t == 0:
        return q, k
    half = rot // 2
    block_half = triton.next_power_of_2(half)
    # Up to ~2K elements per rotated tile: all heads of a token in one or a few steps.
    cap = max(1, 2048 // block_half)
    _rotary_kernel[(t,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        hq, k.shape[1],
        HALF=half, BLOCK_HALF=block_half,
        BLOCK_HQ=min(triton.next_power_of_2(hq), cap),
        BLOCK_HK=min(triton.next_power_of_2(k.shape[1]), cap), num_warps=4,
    )
    return q, k

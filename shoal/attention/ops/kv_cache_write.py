"""Scatter the step's new keys and values into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_cache_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch,
    num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    # int64: slot * stride overflows int32 on caches of a few GiB.
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    # Negative slots are CUDA-graph padding rows: nothing to write.
    mask = (offs_h < tl.where(slot >= 0, num_heads, 0))[:, None]
    src_k = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_slots, Hk, D]; k, v: [T, Hk, D] (rows may be strided views of a fused
    qkv output); slot_mapping: [T] int32/int64, entries < 0 are skipped."""
    t, hk, d = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if kv_cache.dim() != 4 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[2:]) != (hk, d):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [2, slots, {hk}, {d}]")
    if not (k.dtype == v.dtype == kv_cache.dtype):
        raise ValueError(f"dtypes differ: k {k.dtype}, v {v.dtype}, cache {kv_cache.dtype}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{t}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(3) != 1:
        raise ValueError("the head dim must be contiguous")
    if kv_cache.stride(1) != kv_cache.stride(2) * hk:
        raise ValueError("cache slots must be contiguous rows of Hk * D")
    if d & (d - 1):
        raise ValueError(f"head dim {d} is not a power of two")
    if t == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # About 2K elements per program: one program per token for typical Hk * D.
    block_h = min(triton.next_power_of_2(hk), max(1, 2048 // d))
    grid = (t, triton.cdiv(hk, block_h))
    _kv_cache_write_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        hk,
        HEAD_DIM=d, BLOCK_H=block_h, num_warps=4,
    )

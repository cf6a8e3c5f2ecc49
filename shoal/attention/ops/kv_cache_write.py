"""Scatter the step's new keys and values into their paged-cache slots. An FP8 cache
(attention/kv_quant.py) takes them divided by their scale, saturated and rounded (KV_FP8)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.attention.ops.fp8 import check_fp8_cache, to_fp8


@triton.jit
def _kv_cache_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch,
    num_heads, k_scale, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, KV_FP8: tl.constexpr,
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
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    if KV_FP8:
        k = to_fp8(k, k_scale, k_cache_ptr.dtype.element_ty)
        v = to_fp8(v, v_scale, v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """kv_cache: [2, num_slots, Hk, D]; k, v: [T, Hk, D] (rows may be strided views of a fused
    qkv output); slot_mapping: [T] int32/int64, entries < 0 are skipped. An FP8 cache stores
    k / k_scale and v / v_scale."""
    t, hk, d = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if kv_cache.dim() != 4 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[2:]) != (hk, d):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [2, slots, {hk}, {d}]")
    fp8 = check_fp8_cache(kv_cache, k.dtype)
    if k.dtype != v.dtype or (k.dtype != kv_cache.dtype and not fp8):
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
        hk, k_scale, v_scale,
        HEAD_DIM=d, BLOCK_H=block_h, KV_FP8=fp8, num_warps=4,
    )

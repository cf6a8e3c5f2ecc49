"""Scatter the step's new MLA latent rows (kv_lora_rank latent values + the rotary key) into
their paged-cache slots. An FP8 cache takes each row divided by its one scale, saturated and
rounded (KV_FP8, ops/fp8.py)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shoal.attention import kv_quant
from shoal.attention.ops.fp8 import check_fp8_cache, to_fp8


@triton.jit
def _mla_cache_write_kernel(
    latent_ptr, cache_ptr, slot_ptr,
    stride_lt, stride_cs, dk, scale,
    BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    # int64: slot * stride overflows int32 on caches of a few GiB.
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    # Negative slots are CUDA-graph padding rows: nothing to write.
    mask = offs < tl.where(slot >= 0, dk, 0)
    row = tl.load(latent_ptr + t.to(tl.int64) * stride_lt + offs, mask=mask)
    if KV_FP8:
        row = to_fp8(row, scale, cache_ptr.dtype.element_ty)
    tl.store(cache_ptr + slot * stride_cs + offs, row, mask=mask)


def _use_kernel(cache: torch.Tensor) -> bool:
    return cache.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def write_mla_cache(latent: torch.Tensor, cache: torch.Tensor,
                    slot_mapping: torch.Tensor, scale: float = 1.0) -> None:
    """latent: [T, Dk] (rows may be a strided view of a fused projection output, Dk
    contiguous); cache: [num_slots, Dk] (latent's dtype, or FP8: latent / scale);
    slot_mapping: int32/int64 [T], entries < 0 are skipped. The Triton kernel runs on CUDA
    tensors (and under TRITON_INTERPRET=1); other tensors take the PyTorch path."""
    if latent.dim() != 2 or cache.dim() != 2 or latent.shape[1] != cache.shape[1]:
        raise ValueError(f"latent {tuple(latent.shape)} does not fit cache "
                         f"{tuple(cache.shape)} ([T, Dk] and [num_slots, Dk])")
    t, dk = latent.shape
    fp8 = check_fp8_cache(cache, latent.dtype)
    if latent.dtype != cache.dtype and not fp8:
        raise ValueError(f"dtypes differ: latent {latent.dtype}, cache {cache.dtype}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{t}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if latent.stride(1) != 1 or cache.stride(1) != 1 or slot_mapping.stride(0) != 1:
        raise ValueError("latent and cache rows and slot_mapping must be contiguous")
    if t == 0:
        return
    if not _use_kernel(cache):
        keep = slot_mapping >= 0
        rows = kv_quant.quantize(latent[keep], scale) if fp8 else latent[keep]
        cache[slot_mapping[keep].long()] = rows
        return
    # One program per token for Dk up to 1024 (DeepSeek: 576 of a 1024-wide masked tile).
    block_d = min(triton.next_power_of_2(dk), 1024)
    _mla_cache_write_kernel[(t, triton.cdiv(dk, block_d))](
        latent, cache, slot_mapping,
        latent.stride(0), cache.stride(0), dk, scale,
        BLOCK_D=block_d, KV_FP8=fp8, num_warps=4,
    )

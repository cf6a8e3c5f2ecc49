"""Argument checks shared by the paged attention kernels' wrappers: a bad shape, dtype or
stride must raise here, not read out of bounds on the GPU."""

from __future__ import annotations

import torch

from shoal.attention.ops.fp8 import Q_DTYPES, check_fp8_cache


def check_paged_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, rows: int, block_size: int) -> None:
    """q: [*, Hq, D]; kv_cache: [2, slots, Hk, D] of q's dtype or FP8; block_tables int32
    [>= rows, N]; seq_lens int32 [>= rows]."""
    hq, d = q.shape[-2], q.shape[-1]
    if kv_cache.dim() != 4 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [2, slots, Hk, D]")
    hk, dc = kv_cache.shape[2], kv_cache.shape[3]
    if dc != d or hq % hk:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(kv_cache.shape)}")
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"head dim {d} unsupported (powers of two 16..256)")
    if q.dtype not in Q_DTYPES or (q.dtype != kv_cache.dtype
                                   and not check_fp8_cache(kv_cache, q.dtype)):
        raise ValueError(f"q {q.dtype} and cache {kv_cache.dtype} must be one of fp16/bf16/fp32 "
                         "(the cache may be FP8)")
    if q.stride(-1) != 1 or kv_cache.stride(3) != 1:
        raise ValueError("the head dim must be contiguous")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] < rows:
        raise ValueError(f"block_tables must be int32 [>={rows}, N], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or seq_lens.shape[0] < rows:
        raise ValueError(f"seq_lens must be int32 [>={rows}], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if block_size < 1 or kv_cache.shape[1] % block_size:
        raise ValueError(f"cache slots {kv_cache.shape[1]} are not whole blocks of {block_size}")


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """sinks: None, or one contiguous logit per query head on q's device."""
    if sinks is None:
        return
    if sinks.shape != (num_heads,) or sinks.stride(0) != 1 or sinks.device != device \
            or not sinks.is_floating_point():
        raise ValueError(f"sinks must be a contiguous float [{num_heads}] on {device}, got "
                         f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")

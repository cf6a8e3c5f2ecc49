"""The CPU paged decode attention kernel (shoal/csrc/paged_decode_cpu.cpp, built and loaded
by shoal/cpu_kernels.py): whether a call fits its contract, and the call.

SHOAL_CPU_DECODE_KERNEL=0 (shoal/envs.py) forces the torch path (A/B runs)."""

from __future__ import annotations

import functools
import logging

import torch

from shoal import cpu_kernels, envs

logger = logging.getLogger(__name__)

MAX_GROUP, MAX_DIM = 16, 256  # the kernel's per-task buffers (kMaxGroup, kMaxDim)
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def unavailable_reason() -> str | None:
    """Why the kernel cannot serve this process (logged once), or None once it is loaded."""
    switch = envs.SHOAL_CPU_DECODE_KERNEL
    if not switch.get():
        logger.info("CPU paged decode kernel off (%s=0): the torch path serves decodes",
                    switch.name)
        return f"{switch.name}=0"
    return cpu_kernels.unavailable_reason()


def available() -> bool:
    return unavailable_reason() is None


def fits(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether q [B, Hq, D] and kv_cache [2, slots, Hk, D] are inside the kernel's contract."""
    hq, d = q.shape[-2], q.shape[-1]
    hk = kv_cache.shape[2]
    return (q.device.type == "cpu" and q.dtype in DTYPES and kv_cache.dtype == q.dtype
            and kv_cache.shape[3] == d and hq % hk == 0 and hq // hk <= MAX_GROUP
            and d <= MAX_DIM and q.stride(-1) == 1 and kv_cache.is_contiguous())


def cpu_paged_decode(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                     scale: float, sliding_window: int | None = None) -> None:
    """Writes into out [B, Hq, D] the attention of q [B, Hq, D] (the token at position
    seq_lens[b] - 1 of each sequence, already in the cache) over keys [0, seq_lens[b]) of
    kv_cache [2, slots, Hk, D], read through block_tables [>= B, N] int64. With a sliding
    window only the last `sliding_window` keys count. seq_lens: int64 [>= B]; 0 gives zeros.
    Call only when available() and fits(q, kv_cache)."""
    torch.ops.shoal_cpu.paged_decode(out, q, kv_cache[0], kv_cache[1], block_tables, seq_lens,
                                     block_size, scale, sliding_window or 0)

"""Compiles every variant of the paged attention kernels that real traffic can pick.

Triton compiles a kernel on first use of each set of constexprs. The dummy steps of the
start-up warmup have short contexts, so they only ever see one decode split and few prefill
tile heights; a long conversation or a mixed step later picks another (split counts up to
MAX_SPLITS, every query-tile height) and would stall that step for a compile, hundreds of
milliseconds on a busy host. Each variant here runs once on a one-block request.

Soft-capping (Gemma 2) is a constexpr of both paged kernels (SOFTCAP: capped or not) while
the cap's value is a runtime argument, so the caller passes the caps of the layers that
share the cache and each of the two variants runs once, with one of those caps."""

from __future__ import annotations

from collections.abc import Collection

import torch

from shoal.attention.ops.mla_decode import mla_paged_decode
from shoal.attention.ops.mla_prefill import mla_paged_prefill
from shoal.attention.ops.paged_decode import MAX_SPLITS, paged_decode
from shoal.attention.ops.paged_prefill import paged_prefill, prefill_tile_heights


def softcap_variants(softcaps: Collection[float | None]) -> list[float | None]:
    """One cap per compiled variant the caps need: None (uncapped) if among them, and the
    smallest cap if any (every cap runs the one capped variant)."""
    caps = sorted(c for c in softcaps if c is not None)
    return ([None] if None in softcaps else []) + caps[:1]


@torch.inference_mode()
def warm_paged_attention(kv_cache: torch.Tensor, num_heads: int, scale: float, block_size: int,
                         sliding_window: int | None, q_dtype: torch.dtype | None = None,
                         softcaps: Collection[float | None] = (None,)) -> int:
    """kv_cache: a layer's [2, slots, Hk, D] cache (block 0 is read, nothing is written);
    q_dtype: the activations' (None: the cache's); softcaps: the attention soft-caps of the
    layers on this cache (None: uncapped). Returns how many kernel variants ran."""
    d, dev, dtype = kv_cache.shape[3], kv_cache.device, q_dtype or kv_cache.dtype
    q = torch.zeros(1, num_heads, d, dtype=dtype, device=dev)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    lens = torch.ones(1, dtype=torch.int32, device=dev)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    group = num_heads // kv_cache.shape[2]
    runs = 0
    for cap in softcap_variants(softcaps):
        splits = 1
        while splits <= MAX_SPLITS:  # the split count paged_decode picks is a power of two
            paged_decode(q, kv_cache, tables, lens, block_size, scale,
                         sliding_window=sliding_window, num_splits=splits, softcap=cap)
            splits *= 2
            runs += 1
        for block_m in prefill_tile_heights(group, d, dtype):
            paged_prefill(q, kv_cache, tables, lens, starts, 1, block_size, scale,
                          sliding_window=sliding_window, block_m=block_m, softcap=cap)
            runs += 1
    return runs


@torch.inference_mode()
def warm_latent_attention(kv_cache: torch.Tensor, num_heads: int, scale: float,
                          block_size: int, v_dim: int, q_dtype: torch.dtype | None = None) -> int:
    """The same for latent attention: kv_cache is a layer's [1, slots, 1, Dk] cache. The MLA
    decode kernel compiles once with and once without split-K (the split count is a runtime
    argument); the prefill kernel once per query-tile height, which the chunk length picks."""
    dk, dev, dtype = kv_cache.shape[3], kv_cache.device, q_dtype or kv_cache.dtype
    cache = kv_cache.view(kv_cache.shape[1], dk)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    runs = 0
    for splits in (1, 2):
        q = torch.zeros(1, num_heads, dk, dtype=dtype, device=dev)
        lens = torch.ones(1, dtype=torch.int32, device=dev)
        mla_paged_decode(q, cache, tables, lens, block_size, scale, v_dim, num_splits=splits)
        runs += 1
    n = 1
    while n <= min(block_size, 64):  # the tile height grows with the chunk up to its cap
        q = torch.zeros(n, num_heads, dk, dtype=dtype, device=dev)
        lens = torch.tensor([n], dtype=torch.int32, device=dev)
        starts = torch.tensor([0, n], dtype=torch.int32, device=dev)
        mla_paged_prefill(q, cache, tables, lens, starts, n, block_size, scale, v_dim)
        n *= 2
        runs += 1
    return runs

"""Sparse latent attention (DeepSeek-V3.2's DeepSeek Sparse Attention) over a paged latent
cache, in the weight-absorbed form of mla_decode.py: each query row attends only to the
cached tokens the lightning indexer picked for it (shoal/layers/sparse_picks.py).

A row is one query token [H, Dk] of any request, a decode or a token of a prefill chunk
alike (each has its own picks, so nothing is shared between rows). It reads:
- picks [R, K]: positions in its request's sequence, best first, so the ones it may see come
  first (torch.topk of scores that are -inf past the row, as the indexer gives them); a pick
  < 0 or >= seen is masked;
- seen [R]: how many keys it may see (its position + 1; 0 on a padding row, whose output is
  zero and which reads nothing), so the loop runs over its first min(K, seen) picks;
- table_rows [R]: which row of the block tables is its request's (a chunk's tokens share one).
Position p lies in block table[p // bs], slot p % bs; each picked latent row is loaded as its
v_dim and rope parts (Dk is no power of two), the key is the whole row and the value its
v_dim part, as in mla_decode.py.

A program owns one row, BLOCK_H query heads (every head reads the same picked rows, so one
gather serves them all) and one split of the row's picks. Launch shapes follow R, H and K
only and the per-row counts are read on the device: CUDA-graph safe. The splits combine in
mla_decode's reduce kernel (the same scratch layout). An FP8 cache (KV_FP8): tiles converted
to q's dtype as loaded, the row's scale folded into qk_scale and applied to the output."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal.attention.ops.fp8 import check_fp8_cache
from shoal.attention.ops.key_splits import sm_count, split_range
from shoal.attention.ops.mla_decode import (
    _mla_split_reduce_kernel,
    attend_latent_tile,
    check_mla_inputs,
    choose_num_splits,
    decode_config,
    store_latent_out,
)

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "-inf" for the running max: no inf - inf = nan
_LOG2E = 1.4426950408889634
BLOCK_H = 16  # heads per program: the smallest tl.dot tile height
MAX_GRID_ROWS = 65535  # a launch's rows (the grid's second axis: CUDA's limit)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class SparseRows:
    """The rows each query of a step reads (the Triton backend's form of the indexer's
    selection): for every query row of the step, in token order (padding rows included)."""

    picks: torch.Tensor  # [T, K] positions, best first (the visible ones lead); < 0: none
    seen: torch.Tensor  # [T] int32: keys the row may see (position + 1; 0: padding)
    table_rows: torch.Tensor  # [T] int32/int64: the row of the block tables it reads


# Per-step ints are not specialized (== 1, % 16), so steps do not trigger new compiles.
@triton.jit(do_not_specialize=["num_splits", "n_picks", "table_cols", "stride_bt",
                               "stride_pk"])
def _mla_sparse_kernel(
    q_ptr, cache_ptr, block_tables_ptr, table_rows_ptr, seen_ptr, picks_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, v_scale, num_splits, n_picks, table_cols,
    stride_qr, stride_qh, stride_cs, stride_bt, stride_pk, stride_or, stride_oh,
    num_heads,
    BLOCK_H: tl.constexpr, V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    # head blocks vary fastest: the programs gathering the same rows run side by side
    hb = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seen = tl.load(seen_ptr + r).to(tl.int64)
    n = tl.maximum(tl.minimum(seen, n_picks), 0)  # its visible picks lead: read no further
    lo, hi = split_range(0, n, split, num_splits, BLOCK_N)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_v = tl.arange(0, V_DIM)
    offs_r = tl.arange(0, ROPE_DIM)
    q_row = q_ptr + r * stride_qr + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :], mask=h_mask[:, None], other=0.0)
    q_pe = tl.load(q_row + V_DIM + offs_r[None, :], mask=h_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, V_DIM], tl.float32)
    table = block_tables_ptr + tl.load(table_rows_ptr + r).to(tl.int64) * stride_bt
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        pos = tl.load(picks_ptr + r * stride_pk + j, mask=j < hi, other=-1).to(tl.int64)
        valid = (j < hi) & (pos >= 0) & (pos < seen)
        # (clamped: a graph's padding row of q > 1 tokens may claim more than its table)
        col = tl.minimum(pos // BLOCK_SIZE, table_cols - 1)
        block = tl.load(table + col, mask=valid, other=0).to(tl.int64)
        m_i, l_i, acc = attend_latent_tile(
            q_nope, q_pe, cache_ptr, block * BLOCK_SIZE + pos % BLOCK_SIZE, valid, stride_cs,
            m_i, l_i, acc, qk_scale, V_DIM, ROPE_DIM, DOT_PRECISION, KV_FP8)
    store_latent_out(acc, l_i, m_i, v_scale, r, heads, h_mask, split, num_heads, num_splits,
                     out_ptr, stride_or, stride_oh, part_out_ptr, part_lse_ptr, V_DIM, SPLIT,
                     KV_FP8)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return sm_count(device, 132)  # (the interpreter: an H100's)


def _check(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
           rows: SparseRows, block_size: int, v_dim: int) -> None:
    # (the tables' rows are requests, not query rows: their count is not checked here, and
    # table_rows, read on the device, must name rows of them, as the metadata's do)
    r = q.shape[0]
    picks, seen, table_rows = rows.picks, rows.seen, rows.table_rows
    if seen.dtype != torch.int32 or seen.dim() != 1 or seen.shape[0] < r \
            or seen.stride(0) != 1:
        raise ValueError(f"seen must be a contiguous int32 [>= {r}], got {seen.dtype} "
                         f"{tuple(seen.shape)}")
    check_mla_inputs(q, cache, block_tables, seen, 0, block_size, v_dim)
    if picks.dim() != 2 or picks.shape[0] < r or picks.stride(1) != 1 \
            or picks.dtype not in _INDEX_DTYPES:
        raise ValueError(f"picks must be int32/int64 [>= {r}, K] with contiguous rows, got "
                         f"{picks.dtype} {tuple(picks.shape)}")
    if table_rows.dim() != 1 or table_rows.shape[0] < r or table_rows.stride(0) != 1 \
            or table_rows.dtype not in _INDEX_DTYPES:
        raise ValueError(f"table_rows must be a contiguous int32/int64 [>= {r}], got "
                         f"{table_rows.dtype} {tuple(table_rows.shape)}")
    for name, t in (("picks", picks), ("table_rows", table_rows)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def launch(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, rows: SparseRows,
           block_size: int, scale: float, v_dim: int, *, out: torch.Tensor | None = None,
           kv_scale: float = 1.0, num_splits: int | None = None, block_h: int = BLOCK_H,
           block_n: int | None = None, num_warps: int = 4, num_stages: int = 2
           ) -> torch.Tensor:
    """mla_sparse_attention with its tiling chosen (for timing them)."""
    _check(q, cache, block_tables, rows, block_size, v_dim)
    r, h, dk = q.shape
    if out is None:
        out = torch.empty(r, h, v_dim, dtype=q.dtype, device=q.device)
    elif out.shape != (r, h, v_dim) or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {q.dtype} {(r, h, v_dim)} with contiguous last dim")
    if r > MAX_GRID_ROWS:  # (a long prefill's tokens: the grid's rows axis is short)
        for a in range(0, r, MAX_GRID_ROWS):
            b = min(a + MAX_GRID_ROWS, r)
            part = SparseRows(rows.picks[a:b], rows.seen[a:b], rows.table_rows[a:b])
            launch(q[a:b], cache, block_tables, part, block_size, scale, v_dim, out=out[a:b],
                   kv_scale=kv_scale, num_splits=num_splits, block_h=block_h,
                   block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        return out
    if r == 0 or h == 0:
        return out
    k = rows.picks.shape[1]
    if num_splits is None:  # (from shapes only: a CUDA graph's stays fixed)
        num_splits = choose_num_splits(r, h, k, _num_sms(q.device))
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits {num_splits} out of range [1, 1024]")
    if block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"block_h {block_h} must be a power of two >= 16")
    fp8 = check_fp8_cache(cache, q.dtype)
    if block_n is None:
        block_n = decode_config(q.dtype, v_dim)[0]
    split = num_splits > 1
    part_out = part_lse = out  # (unused without splits)
    if split:
        part_out = torch.empty(r, h, num_splits, v_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(r, h, num_splits, dtype=torch.float32, device=q.device)
    _mla_sparse_kernel[(triton.cdiv(h, block_h), r, num_splits)](
        q, cache, block_tables, rows.table_rows, rows.seen, rows.picks,
        out, part_out, part_lse,
        scale * _LOG2E * (kv_scale if fp8 else 1.0), kv_scale, num_splits, k,
        block_tables.shape[1],
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0),
        rows.picks.stride(0), out.stride(0), out.stride(1), h,
        BLOCK_H=block_h, V_DIM=v_dim, ROPE_DIM=dk - v_dim, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=fp8,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _mla_split_reduce_kernel[(r, h)](
            part_out, part_lse, out, out.stride(0), out.stride(1), h, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), V_DIM=v_dim, num_warps=4,
        )
    return out


def mla_sparse_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         rows: SparseRows, block_size: int, scale: float, v_dim: int, *,
                         out: torch.Tensor | None = None, kv_scale: float = 1.0,
                         num_splits: int | None = None) -> torch.Tensor:
    """q [R, H, Dk] (the absorbed query of each row; any strides in R and H, Dk contiguous),
    cache [num_slots, Dk] latent rows (v_dim latent values, then the rotary key part; every
    row the step reads already written), block_tables int32 [B, N] (the rows' requests'),
    rows: each row's picks, seen count and table row (SparseRows) -> out [R, H, v_dim] in q's
    dtype: softmax over the row's picks of q . latent * scale, times latent[:, :v_dim]. An
    FP8 cache is read as stored * kv_scale. num_splits None picks one from the shapes."""
    return launch(q, cache, block_tables, rows, block_size, scale, v_dim, out=out,
                  kv_scale=kv_scale, num_splits=num_splits)

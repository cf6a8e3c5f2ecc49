"""Prefill / chunked-prefill attention for multi-head latent attention (MLA) over a paged
latent cache, in the weight-absorbed form (flash-style online softmax).

See mla_decode.py for the layout: one latent row of Dk = v_dim + rope_dim values per token,
shared by every head, key = the whole row, value = its first v_dim values. Queries of several
sequences are packed [T, H, Dk] and delimited by query_start_loc; query i of a sequence sits
at absolute position seq_len - q_len + i and sees cached keys up to and including itself
(the step's own latents were written to the cache first).

One program handles BLOCK_Q consecutive query tokens times BLOCK_H heads, laid out as
BLOCK_M = BLOCK_Q * BLOCK_H rows (token-major), so every latent tile read serves them all.
Keys before the tile's first query are visible to every row: those whole tiles skip the
causal and bounds masks; only the tail near the diagonal pays for them.

The absorbed form costs Dk + v_dim multiply-adds per (query head, key) against
qk_head_dim + v_head_dim for the expanded one (DeepSeek: 1088 vs 320); a long prompt is
compute-bound and would run faster up-projected to per-head K/V. This kernel keeps the
whole step in latent space (no per-step up-projection of the cached context).

An FP8 cache (KV_FP8, see ops/fp8.py): tiles are converted to q's dtype as loaded; the row's
one scale is folded into qk_scale and multiplies the output."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shoal.attention.ops.fp8 import check_fp8_cache
from shoal.attention.ops.key_splits import sm_count
from shoal.attention.ops.mla_decode import check_mla_inputs

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "-inf" for the running max: masked rows stay nan-free
_LOG2E = 1.4426950408889634


@triton.jit
def _attend(acc, l_i, m_i, q_nope, q_pe, q_pos, cache_ptr, bt_row, lo, hi, qk_scale,
            stride_cs, offs_v, offs_r,
            V_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr):
    """Online-softmax update over keys [lo, hi). MASKED: apply bounds and causal masks (else
    every key in whole tiles of [lo, hi) is visible to every row)."""
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = pos < hi
            block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        else:
            block = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
        row = cache_ptr + ((block * BLOCK_SIZE + pos % BLOCK_SIZE) * stride_cs)[:, None]
        if MASKED:
            kv = tl.load(row + offs_v[None, :], mask=valid[:, None], other=0.0)
            k_pe = tl.load(row + V_DIM + offs_r[None, :], mask=valid[:, None], other=0.0)
        else:
            kv = tl.load(row + offs_v[None, :])
            k_pe = tl.load(row + V_DIM + offs_r[None, :])
        if KV_FP8:
            kv = kv.to(q_nope.dtype)
            k_pe = k_pe.to(q_nope.dtype)
        s = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s *= qk_scale
        if MASKED:
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Per-step ints are not specialized (== 1, % 16), so steps do not trigger new compiles; the
# per-request tensors always come as whole tensors plus first_row (a slice would move their
# pointers off 16-byte alignment, a specialization Triton would compile anew).
@triton.jit(do_not_specialize=["num_q_tiles", "first_row", "stride_bt"])
def _mla_prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr,
    qk_scale, v_scale, num_q_tiles, first_row,
    stride_qt, stride_qh, stride_cs, stride_bt, stride_ot, stride_oh,
    num_heads,
    BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, V_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    # Later query tiles see more keys: launch them first so the tail of the grid is short.
    tile = num_q_tiles - 1 - tl.program_id(0)
    seq = first_row + tl.program_id(1)
    hb = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    BLOCK_Q: tl.constexpr = BLOCK_M // BLOCK_H
    t0 = tile * BLOCK_Q
    if t0 >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_v = tl.arange(0, V_DIM)
    offs_r = tl.arange(0, ROPE_DIM)
    tok = t0 + offs_m // BLOCK_H
    heads = hb * BLOCK_H + offs_m % BLOCK_H
    row_mask = (tok < q_len) & (heads < num_heads)
    q_row = q_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_qt \
        + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :], mask=row_mask[:, None], other=0.0)
    q_pe = tl.load(q_row + V_DIM + offs_r[None, :], mask=row_mask[:, None], other=0.0)
    q_pos = ctx + tok

    first = ctx + t0  # position of the tile's first query
    hi = tl.minimum(first + BLOCK_Q, ctx + q_len)  # one past the tile's last query
    mid = (first // BLOCK_N) * BLOCK_N  # whole key tiles strictly before `first`

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_DIM], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    acc, l_i, m_i = _attend(acc, l_i, m_i, q_nope, q_pe, q_pos, cache_ptr, bt_row, 0, mid,
                            qk_scale, stride_cs, offs_v, offs_r,
                            V_DIM, BLOCK_N, BLOCK_SIZE, False, DOT_PRECISION, KV_FP8)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q_nope, q_pe, q_pos, cache_ptr, bt_row, mid, hi,
                            qk_scale, stride_cs, offs_v, offs_r,
                            V_DIM, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION, KV_FP8)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    if KV_FP8:
        o = o * v_scale
    tl.store(out_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_ot
             + heads[:, None] * stride_oh + offs_v[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@functools.cache
def _num_sms(device: torch.device) -> int:
    return sm_count(device, 0)  # (0 elsewhere: no occupancy heuristic)


def prefill_config(num_heads: int, max_query_len: int, num_seqs: int, dtype: torch.dtype,
                   v_dim: int, num_sms: int = 0) -> tuple[int, int, int, int, int]:
    """(BLOCK_H, BLOCK_M, BLOCK_N, num_warps, num_stages). The fp32 accumulator is
    BLOCK_M x v_dim: 64 rows of 512 (DeepSeek) already take 128 registers a thread with 8
    warps, so tiles stay smaller than paged_prefill's; fp32 (no tensor cores, a correctness
    path) halves them."""
    shrink = 2 if dtype == torch.float32 else 1
    wide = v_dim > 256
    block_h = min(16, triton.next_power_of_2(num_heads))
    cap = (64 if wide else 128) // shrink
    low = max(16, block_h)
    # Fewer rows for short chunks, so a one-token chunk does not drag empty rows along.
    block_m = max(low, min(cap, triton.next_power_of_2(max(max_query_len, 1) * block_h)))
    # A short chunk over a long context makes few programs: trade reuse for more of them.
    head_blocks = triton.cdiv(num_heads, block_h)
    while (block_m > low and num_sms
           and triton.cdiv(max_query_len, block_m // block_h) * num_seqs * head_blocks < num_sms):
        block_m //= 2
    block_n = (32 if wide else 64) // shrink
    num_warps = 8 if block_m * shrink >= 64 else 4
    return block_h, block_m, block_n, num_warps, 1 if wide else 2


def mla_paged_prefill(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                      block_size: int, scale: float, v_dim: int, *,
                      out: torch.Tensor | None = None, first_row: int = 0,
                      kv_scale: float = 1.0) -> torch.Tensor:
    """q: [T, H, Dk] absorbed queries (last dim contiguous); cache: [num_slots, Dk] already
    holding every latent of the step, the new ones included; block_tables: int32 [P, N];
    seq_lens: int32 [P] (context + query tokens); query_start_loc: int32 [P + 1], token
    offsets into q of each sequence's queries (rows of out outside them are left untouched);
    max_query_len: an upper bound on any query_start_loc difference (it sizes the grid).
    Rows before first_row of the per-request tensors belong to others (decodes) and are
    skipped. Returns out [T, H, v_dim] in q's dtype. An FP8 cache is read as stored *
    kv_scale."""
    t, h, dk = q.shape
    if query_start_loc.dtype != torch.int32 or query_start_loc.dim() != 1 \
            or query_start_loc.shape[0] < 1 or query_start_loc.stride(0) != 1:
        raise ValueError("query_start_loc must be a contiguous int32 [P + 1]")
    num_reqs = query_start_loc.shape[0] - 1
    check_mla_inputs(q, cache, block_tables, seq_lens, num_reqs, block_size, v_dim)
    if out is None:
        out = torch.empty(t, h, v_dim, dtype=q.dtype, device=q.device)
    elif out.shape != (t, h, v_dim) or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {q.dtype} {(t, h, v_dim)} with contiguous last dim")
    if not 0 <= first_row <= num_reqs:
        raise ValueError(f"first_row {first_row} is outside the {num_reqs} requests")
    num_seqs = num_reqs - first_row
    if num_seqs == 0 or max_query_len <= 0 or t == 0 or h == 0:
        return out

    fp8 = check_fp8_cache(cache, q.dtype)
    block_h, block_m, block_n, num_warps, num_stages = prefill_config(
        h, max_query_len, num_seqs, q.dtype, v_dim, _num_sms(q.device))
    num_q_tiles = triton.cdiv(max_query_len, block_m // block_h)
    _mla_prefill_kernel[(num_q_tiles, num_seqs, triton.cdiv(h, block_h))](
        q, cache, block_tables, seq_lens, query_start_loc, out,
        scale * _LOG2E * (kv_scale if fp8 else 1.0), kv_scale, num_q_tiles, first_row,
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1), h,
        BLOCK_H=block_h, BLOCK_M=block_m, V_DIM=v_dim, ROPE_DIM=dk - v_dim, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=fp8, num_warps=num_warps, num_stages=num_stages,
    )
    return out

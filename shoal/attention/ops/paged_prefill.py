"""Prefill / chunked-prefill attention over the paged KV cache (flash-style online softmax).

Queries of several sequences are packed [T, Hq, D] and delimited by query_start_loc. Query i
of a sequence sits at absolute position context_len + i and sees cached keys up to and
including itself (its own new keys were written to the cache first).

One program handles BLOCK_Q consecutive query tokens times all query heads of one KV head,
laid out as BLOCK_M = BLOCK_Q * BLOCK_G rows (token-major), so every K/V tile read serves the
whole GQA group. Keys before the tile's first query are visible to every row: those whole
tiles skip the causal and bounds masks; only the tail near the diagonal pays for them.

Attention sinks (gpt-oss) start each row's online softmax as if one key of the row's head's
sink logit, with a zero value, had been seen: running max = the sink, sum = 1.

Soft-capping (SOFTCAP, Gemma 2) as in ops/paged_decode.py: scores are capped before the
causal, bounds and window masks and the running max.

An FP8 cache (KV_FP8, see ops/fp8.py): tiles are converted to q's dtype as loaded, k_scale is
folded into qk_scale and v_scale multiplies the output."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shoal.attention.ops.checks import check_paged_inputs, check_sinks
from shoal.attention.ops.fp8 import check_fp8_cache
from shoal.attention.ops.key_splits import sm_count
from shoal.attention.ops.paged_decode import logits, score_scales

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "-inf" for the running max: rows masked out of a tile stay nan-free
_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)  # sinks are natural-log logits; the kernel works in base 2


@triton.jit
def _attend(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_off, lo, hi,
            qk_scale, cap, window, stride_cs, offs_d,
            BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
            USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
            SOFTCAP: tl.constexpr):
    """Online-softmax update over keys [lo, hi). MASKED: apply bounds and causal masks (else
    every key in whole tiles of [lo, hi) is visible to every row)."""
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = pos < hi
            block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        else:
            block = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
        kv_off = ((block * BLOCK_SIZE + pos % BLOCK_SIZE) * stride_cs)[:, None] \
            + head_off + offs_d[None, :]
        if MASKED:
            k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_off)
            v = tl.load(v_cache_ptr + kv_off)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = logits(q, k, qk_scale, cap, SOFTCAP, DOT_PRECISION)
        if MASKED:
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        if USE_WINDOW:
            s = tl.where(pos[None, :] > q_pos[:, None] - window, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Per-step ints are not specialized (== 1, % 16), so steps do not trigger new compiles; the
# per-request tensors always come as whole tensors plus first_row (a slice of them would move
# their pointers off 16-byte alignment, a specialization Triton would compile anew).
@triton.jit(do_not_specialize=["window", "num_q_tiles", "first_row", "stride_bt"])
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr,
    sinks_ptr, qk_scale, cap, v_scale, window, num_q_tiles, first_row,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # Later query tiles see more keys: launch them first so the tail of the grid is short.
    tile = num_q_tiles - 1 - tl.program_id(0)
    seq = first_row + tl.program_id(1)
    kh = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    BLOCK_Q: tl.constexpr = BLOCK_M // BLOCK_G
    t0 = tile * BLOCK_Q
    if t0 >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = t0 + offs_m // BLOCK_G
    hg = offs_m % BLOCK_G
    row_mask = (tok < q_len) & (hg < GROUP)
    heads = kh * GROUP + hg
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    q_pos = ctx + tok

    first = ctx + t0  # position of the tile's first query
    hi = tl.minimum(first + BLOCK_Q, ctx + q_len)  # one past the tile's last query
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    mid = lo + ((first - lo) // BLOCK_N) * BLOCK_N  # whole tiles strictly before `first`

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + heads, mask=hg < GROUP, other=0.0).to(tl.float32) * _LOG2E_C
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    head_off = kh * stride_ch
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row,
                            head_off, lo, mid, qk_scale, cap, window, stride_cs, offs_d,
                            BLOCK_N, BLOCK_SIZE, False, USE_WINDOW, DOT_PRECISION, KV_FP8,
                            SOFTCAP)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row,
                            head_off, mid, hi, qk_scale, cap, window, stride_cs, offs_d,
                            BLOCK_N, BLOCK_SIZE, True, USE_WINDOW, DOT_PRECISION, KV_FP8,
                            SOFTCAP)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    if KV_FP8:
        o = o * v_scale
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@functools.cache
def _num_sms(device: torch.device) -> int:
    return sm_count(device, 0)  # (0 elsewhere: no occupancy heuristic)


def prefill_tile_heights(group: int, head_dim: int, dtype: torch.dtype) -> list[int]:
    """Every query-tile height (rows = query tokens x grouped heads) paged_prefill may pick:
    the usual flash tile of 128 rows (64 for wide heads) down to 16, halved for fp32."""
    shrink = 2 if dtype == torch.float32 else 1
    cap = (128 if head_dim <= 128 else 64) // shrink
    low = max(16, triton.next_power_of_2(group))
    return [1 << b for b in range(low.bit_length() - 1, cap.bit_length())] if low <= cap \
        else [low]


def _auto_block_m(heights: list[int], max_query_len: int, num_seqs: int, hk: int,
                  block_g: int, device: torch.device) -> int:
    # The full tile for long chunks; fewer rows for short ones so a one-token chunk does not
    # drag 127 empty rows through every product.
    block_m = max(heights[0], min(heights[-1],
                                  triton.next_power_of_2(max_query_len * block_g)))
    # A short chunk over a long cached context (the tail after a prefix-cache hit) makes too
    # few programs to fill the GPU: trade K/V reuse across rows for more, shorter query tiles.
    programs_wanted = _num_sms(device)
    while (block_m > heights[0] and programs_wanted
           and triton.cdiv(max_query_len, block_m // block_g) * num_seqs * hk < programs_wanted):
        block_m //= 2
    return block_m


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                  block_size: int, scale: float, *, sliding_window: int | None = None,
                  out: torch.Tensor | None = None, first_row: int = 0,
                  block_m: int | None = None, sinks: torch.Tensor | None = None,
                  k_scale: float = 1.0, v_scale: float = 1.0,
                  softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; kv_cache: [2, num_slots, Hk, D] already holding every key, the new ones
    included (q's dtype, or FP8 read as stored * k_scale / v_scale); block_tables: int32
    [P, N]; seq_lens: int32 [P] (context + query tokens);
    query_start_loc: int32 [P + 1], token offsets into q of each sequence's queries (rows of q
    outside them are left untouched in out); max_query_len: an upper bound on any
    query_start_loc difference (it sizes the grid). Rows before first_row of the per-request
    tensors belong to others (decodes) and are skipped. block_m forces the query tile height
    (warmup compiles each one). sinks: [Hq] logits or None; softcap: scores capped as
    softcap * tanh(s / softcap), or None. Returns out [T, Hq, D] in q's dtype."""
    t, hq, d = q.shape
    hk = kv_cache.shape[2]
    if query_start_loc.dtype != torch.int32 or query_start_loc.dim() != 1 \
            or query_start_loc.shape[0] < 1 or query_start_loc.stride(0) != 1:
        raise ValueError("query_start_loc must be a contiguous int32 [P + 1]")
    check_paged_inputs(q, kv_cache, block_tables, seq_lens, query_start_loc.shape[0] - 1,
                       block_size)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with contiguous head dim")
    if not 0 <= first_row <= query_start_loc.shape[0] - 1:
        raise ValueError(f"first_row {first_row} is outside the {query_start_loc.shape[0] - 1} "
                         "requests")
    num_seqs = query_start_loc.shape[0] - 1 - first_row
    if num_seqs == 0 or max_query_len <= 0 or t == 0:
        return out
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    check_sinks(sinks, hq, q.device)
    fp8 = check_fp8_cache(kv_cache, q.dtype)
    qk_scale, cap = score_scales(scale * (k_scale if fp8 else 1.0), softcap)

    group = hq // hk
    block_g = triton.next_power_of_2(group)
    # fp32 (no tensor cores, a correctness path) halves both tiles, else it spills.
    shrink = 2 if q.dtype == torch.float32 else 1
    heights = prefill_tile_heights(group, d, q.dtype)
    if block_m is None:
        block_m = _auto_block_m(heights, max_query_len, num_seqs, hk, block_g, q.device)
    elif block_m not in heights:
        raise ValueError(f"block_m {block_m} is not one of {heights}")
    block_n = (64 if d <= 128 else 32) // shrink
    block_q = block_m // block_g
    num_q_tiles = triton.cdiv(max_query_len, block_q)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _paged_prefill_kernel[(num_q_tiles, num_seqs, hk)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        sinks if sinks is not None else q, qk_scale, cap, v_scale,
        sliding_window or 0, num_q_tiles, first_row,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=block_g, BLOCK_M=block_m, HEAD_DIM=d, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, USE_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=fp8, SOFTCAP=softcap is not None,
        num_warps=8 if block_m * shrink >= 128 else 4, num_stages=2,
    )
    return out

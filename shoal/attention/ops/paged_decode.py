"""Decode attention (one query token per sequence) over the paged KV cache.

One program handles all query heads of one KV head of one sequence, so each K/V tile is read
once per group and the group's heads form the rows of a tensor-core product (padded to 16
rows, the smallest tl.dot tile). Keys are gathered row by row through the block table, which
makes the tile size independent of the cache block size.

Split-K: a batch-1 decode has only Hk programs, far too few to fill the GPU, so the context
can be cut into num_splits partitions handled by separate programs; each writes its partial
output and log-sum-exp and a second kernel combines them. The partition length is derived
from each sequence's own length inside the kernel, so a fixed num_splits (as a CUDA graph
needs) works for any length: short sequences leave their trailing splits empty. num_splits
is a runtime argument (only split / no split is compiled separately), so eager decode steps
of varying batch and length do not trigger new JIT compiles.

Attention sinks (gpt-oss: per query head, a logit in the softmax's denominator with no value)
start the online softmax of split 0 as if one key of that logit and a zero value had been
seen: running max = the sink, sum = 1.

Soft-capping (Gemma 2: each score becomes softcap * tanh(score / softcap)) is a constexpr
variant (SOFTCAP; none of its work is compiled in otherwise): the dot product is scaled to
score / softcap, capped by soft_cap, and only then masked and fed to the running max. The cap
is a plain float of the layer, a constant of a captured CUDA graph. Sinks are not capped.

An FP8 cache (KV_FP8, see ops/fp8.py): tiles are converted to q's dtype as loaded, k_scale is
folded into qk_scale and v_scale multiplies each split's output."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from shoal import pdl
from shoal.attention.ops.checks import check_paged_inputs, check_sinks
from shoal.attention.ops.fp8 import check_fp8_cache
from shoal.attention.ops.key_splits import sm_count, split_count, split_range

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "-inf" for the running max: avoids inf - inf = nan on empty rows
_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)  # sinks are natural-log logits; the kernel works in base 2
_NEG_2LOG2E = tl.constexpr(-2.0 * _LOG2E)
MIN_SPLIT_TOKENS = 128  # a split shorter than two key tiles costs more than it saves
MAX_SPLITS = 64


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x), through exp2: Triton has no tanh the interpreter also runs (libdevice's
    is GPU-only). tanh|x| = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: never inf."""
    e = tl.exp2(tl.abs(x) * _NEG_2LOG2E)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t) * cap


@triton.jit
def logits(q, k, qk_scale, cap, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q k^T as base-2 logits (see score_scales): scaled, then capped under SOFTCAP."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        s = soft_cap(s, cap)
    return s


def score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """The kernels' (qk_scale, cap) for an attention scale (an FP8 cache's k_scale folded in).
    Without a cap the dot product times qk_scale is the base-2 logit; with one it is
    score / softcap, which soft_cap(., cap) turns into softcap * tanh(score / softcap) in
    base 2 (cap = softcap * log2 e)."""
    if softcap is None:
        return scale * _LOG2E, 0.0
    if not (isinstance(softcap, (int, float)) and 0 < softcap < math.inf):
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")
    return scale / softcap, float(softcap) * _LOG2E


# Per-step ints are not specialized (== 1, % 16), so steps do not trigger new compiles.
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt"])
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, cap, v_scale, window, num_splits,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    num_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    USE_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.grid_dependency(PDL)
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = 0
    if USE_WINDOW:  # the query at seq_len - 1 sees keys (seq_len - 1 - window, seq_len - 1]
        start = tl.maximum(seq_len - window, 0)
    lo, hi = split_range(start, seq_len, split, num_splits, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kh * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if HAS_SINKS:  # split 0 counts the sink (its value is zero: acc stays 0)
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * _LOG2E_C
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_off = ((block * BLOCK_SIZE + pos % BLOCK_SIZE) * stride_cs)[:, None] \
            + kh * stride_ch + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        s = logits(q, k, qk_scale, cap, SOFTCAP, DOT_PRECISION)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Empty rows (padded batch rows with seq_len 0, empty splits) have l = 0 and output 0.
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    if KV_FP8:
        o = o * v_scale
    if not SPLIT:
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        # Contiguous scratch: part_lse [B, Hq, S], part_out [B, Hq, S, D]. An empty split
        # writes only its -inf lse; the reduce then skips its output row. (Split 0 with a
        # sink is never empty.)
        row = (b * num_heads + heads) * num_splits + split
        tl.store(part_lse_ptr + row, lse, mask=g_mask)
        nonempty = lo < hi
        if HAS_SINKS:
            nonempty = nonempty | (split == 0)
        has_keys = offs_g < tl.where(nonempty, GROUP, 0)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=has_keys[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _split_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ot, stride_oh, num_heads, num_splits,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.grid_dependency(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    row = (b * num_heads + h) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # all splits empty (seq_len 0): weights 0, no nan
    w = tl.exp2(lse - m)
    o = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                mask=(lse > float("-inf"))[:, None], other=0.0)  # unwritten rows of empty splits
    res = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return sm_count(device, 132)  # (the interpreter: an H100's)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int = 132) -> int:
    """Splits per (sequence, KV head), a power of two, so that one to two waves of programs
    fill the GPU, but no split shorter than MIN_SPLIT_TOKENS of the longest context. For CUDA
    graphs pass the longest context the graph may replay with (e.g. max_model_len): the count
    then depends on the padded batch only, and shorter contexts just leave splits empty."""
    return split_count(batch * num_kv_heads, max_seq_len, MIN_SPLIT_TOKENS, MAX_SPLITS,
                       num_sms)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, block_size: int, scale: float, *,
                 sliding_window: int | None = None, num_splits: int | None = None,
                 max_seq_len: int | None = None, out: torch.Tensor | None = None,
                 sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """q: [B, Hq, D], the query of the last token of each sequence (position seq_len - 1);
    kv_cache: [2, num_slots, Hk, D] (q's dtype, or FP8 read as stored * k_scale / v_scale);
    block_tables: int32 [B, N]; seq_lens: int32 [B], 0 for padded rows (their output is
    zero); sinks: [Hq] logits or None; softcap: scores capped as softcap * tanh(s / softcap),
    or None. Returns out [B, Hq, D] in q's dtype.

    num_splits None picks one from max_seq_len (default: the block-table capacity); pass a
    fixed value under CUDA-graph capture."""
    bsz, hq, d = q.shape
    hk = kv_cache.shape[2]
    check_paged_inputs(q, kv_cache, block_tables, seq_lens, bsz, block_size)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with contiguous head dim")
    if bsz == 0:
        return out
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if num_splits is None:
        cap = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(bsz, hk, min(max_seq_len or cap, cap), _num_sms(q.device))
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits {num_splits} out of range")
    check_sinks(sinks, hq, q.device)
    fp8 = check_fp8_cache(kv_cache, q.dtype)
    qk_scale, cap = score_scales(scale * (k_scale if fp8 else 1.0), softcap)

    group = hq // hk
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # Keys per tile: K, V tiles x stages stay well inside shared memory and registers (fp32
    # is a correctness path without tensor cores: half the tile, else it spills).
    block_n = (64 if d <= 128 else 32) // (2 if q.dtype == torch.float32 else 1)
    if num_splits > 1:
        part_out = torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _paged_decode_kernel[(bsz, hk, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, sinks if sinks is not None else q,
        out, part_out, part_lse,
        qk_scale, cap, v_scale, sliding_window or 0, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), hq,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, SPLIT=num_splits > 1,
        USE_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=fp8,
        SOFTCAP=softcap is not None, num_warps=4, num_stages=3 if d <= 128 else 2,
        **pdl.kwargs(q.device),
    )
    if num_splits > 1:
        _split_reduce_kernel[(bsz, hq)](
            part_out, part_lse, out, out.stride(0), out.stride(1), hq, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=d,
            num_warps=4, **pdl.kwargs(q.device),
        )
    return out

"""Decode attention for multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent
cache, in the weight-absorbed form.

Each cached token is one latent row of Dk = v_dim + rope_dim values shared by every query
head (MQA with one KV head): the key is the whole row, the value its first v_dim values.
Each query head brings Dk values (the "nope" part already projected into latent space by
W_UK, then the rotary part). Dk is no power of two (DeepSeek-V3: 512 + 64), so the row is
loaded as its two parts and the score is the sum of a v_dim-wide and a rope_dim-wide dot;
the v_dim part of the key tile is reused, as loaded, as the value tile.

One program handles BLOCK_H query heads (the rows of the tensor-core products, padded to 16)
of one sequence and one split of its context, so every latent tile is read once for all
heads of the block. Split-K as in paged_decode.py: the partition length is derived from each
sequence's own length inside the kernel, so a fixed num_splits (as a CUDA graph needs) works
for any length; each split writes its partial output and log-sum-exp and a second kernel
combines them. num_splits is a runtime argument (only split / no split is compiled
separately).

An FP8 cache (KV_FP8, see ops/fp8.py): tiles are converted to q's dtype as loaded; the row's
one scale is folded into qk_scale and multiplies the output."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shoal.attention.ops.fp8 import Q_DTYPES, check_fp8_cache
from shoal.attention.ops.key_splits import sm_count, split_count, split_range

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "-inf" for the running max: no inf - inf = nan
_LOG2E = 1.4426950408889634
BLOCK_H = 16  # heads per program: the smallest tl.dot tile height
MIN_SPLIT_TOKENS = 128  # a split shorter than a few key tiles costs more than it saves
MAX_SPLITS = 64


def check_mla_inputs(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, rows: int, block_size: int, v_dim: int) -> None:
    """q: [*, H, Dk]; cache: [num_slots, Dk] (q's dtype or FP8); block_tables int32
    [>= rows, N]; seq_lens int32 [>= rows]. A bad shape, dtype or stride raises here instead
    of reading out of bounds."""
    if q.dim() != 3 or cache.dim() != 2:
        raise ValueError(f"q {tuple(q.shape)} must be [*, H, Dk] and cache "
                         f"{tuple(cache.shape)} [num_slots, Dk]")
    dk = q.shape[2]
    if cache.shape[1] != dk:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(cache.shape)}")
    rope_dim = dk - v_dim
    for name, n in (("v_dim", v_dim), ("rope_dim", rope_dim)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} {n} (Dk {dk}, v_dim {v_dim}) is not a power of two >= 16")
    if q.dtype not in Q_DTYPES or (q.dtype != cache.dtype
                                   and not check_fp8_cache(cache, q.dtype)):
        raise ValueError(f"q {q.dtype} and cache {cache.dtype} must be one of fp16/bf16/fp32 "
                         "(the cache may be FP8)")
    if q.stride(2) != 1 or cache.stride(1) != 1:
        raise ValueError("the last dim of q and cache must be contiguous")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 \
            or block_tables.shape[0] < rows or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [>={rows}, N] with contiguous rows, got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or seq_lens.shape[0] < rows \
            or seq_lens.stride(0) != 1:
        raise ValueError(f"seq_lens must be a contiguous int32 [>={rows}], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if block_size < 1 or cache.shape[0] % block_size:
        raise ValueError(f"cache slots {cache.shape[0]} are not whole blocks of {block_size}")
    for name, t in (("cache", cache), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


# Per-step ints are not specialized (== 1, % 16), so steps do not trigger new compiles.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _mla_decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, v_scale, num_splits,
    stride_qb, stride_qh, stride_cs, stride_bt, stride_ob, stride_oh,
    num_heads,
    BLOCK_H: tl.constexpr, V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    # Head blocks vary fastest in launch order: the programs reading the same latent tiles
    # run side by side and share them through L2.
    hb = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo, hi = split_range(0, seq_len, split, num_splits, BLOCK_N)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_v = tl.arange(0, V_DIM)
    offs_r = tl.arange(0, ROPE_DIM)
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :], mask=h_mask[:, None], other=0.0)
    q_pe = tl.load(q_row + V_DIM + offs_r[None, :], mask=h_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, V_DIM], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        m_i, l_i, acc = attend_latent_tile(
            q_nope, q_pe, cache_ptr, block * BLOCK_SIZE + pos % BLOCK_SIZE, valid, stride_cs,
            m_i, l_i, acc, qk_scale, V_DIM, ROPE_DIM, DOT_PRECISION, KV_FP8)
    store_latent_out(acc, l_i, m_i, v_scale, b, heads, h_mask, split, num_heads, num_splits,
                     out_ptr, stride_ob, stride_oh, part_out_ptr, part_lse_ptr, V_DIM, SPLIT,
                     KV_FP8)


@triton.jit
def attend_latent_tile(q_nope, q_pe, cache_ptr, slots, valid, stride_cs, m_i, l_i, acc,
                       qk_scale, V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr):
    """One tile of latent rows (cache slots [BLOCK_N] int64, where valid) into the running
    max, sum and output of BLOCK_H heads: the key is the whole row, the value its v_dim part
    as loaded (mla_decode and mla_sparse's shared step)."""
    offs_v = tl.arange(0, V_DIM)
    offs_r = tl.arange(0, ROPE_DIM)
    row = cache_ptr + (slots * stride_cs)[:, None]
    kv = tl.load(row + offs_v[None, :], mask=valid[:, None], other=0.0)
    k_pe = tl.load(row + V_DIM + offs_r[None, :], mask=valid[:, None], other=0.0)
    if KV_FP8:
        kv = kv.to(q_nope.dtype)
        k_pe = k_pe.to(q_nope.dtype)
    s = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION)
    s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_latent_out(acc, l_i, m_i, v_scale, r, heads, h_mask, split, num_heads, num_splits,
                     out_ptr, stride_or, stride_oh, part_out_ptr, part_lse_ptr,
                     V_DIM: tl.constexpr, SPLIT: tl.constexpr, KV_FP8: tl.constexpr):
    """Row r's output of BLOCK_H heads: whole (no split), or the split's partial output and
    log-sum-exp into the reduce's contiguous scratch, part_lse [R, H, S] and part_out
    [R, H, S, V]. A row or split with nothing read (padding, an empty split) has l = 0: output
    0, or only its -inf lse (the reduce skips its output row)."""
    offs_v = tl.arange(0, V_DIM)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    if KV_FP8:
        o = o * v_scale
    if not SPLIT:
        tl.store(out_ptr + r * stride_or + heads[:, None] * stride_oh + offs_v[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        prow = (r * num_heads + heads) * num_splits + split
        tl.store(part_lse_ptr + prow, lse, mask=h_mask)
        tl.store(part_out_ptr + prow.to(tl.int64)[:, None] * V_DIM + offs_v[None, :], o,
                 mask=(h_mask & (l_i > 0))[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _mla_split_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh, num_heads, num_splits,
    BLOCK_S: tl.constexpr, V_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_v = tl.arange(0, V_DIM)
    row0 = (b * num_heads + h) * num_splits
    lse = tl.load(part_lse_ptr + row0 + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # all splits empty (seq_len 0): weights 0, no nan
    denom = tl.sum(tl.exp2(lse - m), 0)
    # One split's row at a time: [S, V] at once would not fit registers for V = 512.
    acc = tl.zeros([V_DIM], tl.float32)
    for s in range(num_splits):
        lse_s = tl.load(part_lse_ptr + row0 + s)
        # Rows of empty splits (lse -inf) were never written: masked out, weight 0.
        o = tl.load(part_out_ptr + (row0 + s).to(tl.int64) * V_DIM + offs_v,
                    mask=offs_v < tl.where(lse_s > float("-inf"), V_DIM, 0), other=0.0)
        acc += o * tl.exp2(lse_s - m)
    res = acc / tl.maximum(denom, 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_v, res.to(out_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return sm_count(device, 132)  # (the interpreter: an H100's)


def choose_num_splits(batch: int, num_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Context splits per (sequence, block of BLOCK_H query heads), a power of two, so that one
    to two waves of programs fill the GPU, but no split shorter than MIN_SPLIT_TOKENS of the
    longest context. For CUDA graphs pass the longest context the graph may replay with
    (e.g. max_model_len): the count then depends on the padded batch only."""
    return split_count(batch * triton.cdiv(num_heads, BLOCK_H), max_seq_len, MIN_SPLIT_TOKENS,
                       MAX_SPLITS, num_sms)


def decode_config(dtype: torch.dtype, v_dim: int) -> tuple[int, int, int]:
    """(keys per tile, num_warps, num_stages). Per stage a tile holds BLOCK_N x Dk latents;
    fp32 (no tensor cores, a correctness path) halves it, else it spills."""
    block_n = 32 if v_dim <= 512 else 16
    if dtype == torch.float32:
        block_n //= 2
    return block_n, 4, 2


def mla_paged_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, block_size: int, scale: float, v_dim: int, *,
                     num_splits: int | None = None, max_seq_len: int | None = None,
                     out: torch.Tensor | None = None, kv_scale: float = 1.0) -> torch.Tensor:
    """q: [B, H, Dk] (the absorbed query of each sequence's last token, position
    seq_len - 1; any strides in B and H, Dk contiguous); cache: [num_slots, Dk] latent rows
    (v_dim latent values, then rope_dim rotary key values); block_tables: int32 [B, N];
    seq_lens: int32 [B], 0 for padded rows (their output is zero, nothing is read). Returns
    out [B, H, v_dim] in q's dtype: softmax(q . latent * scale) @ latent[:, :v_dim]. An FP8
    cache is read as stored * kv_scale.

    num_splits None picks one from max_seq_len (default: the block-table capacity); pass a
    fixed value under CUDA-graph capture (launch shapes then depend only on B)."""
    bsz, h, dk = q.shape
    check_mla_inputs(q, cache, block_tables, seq_lens, bsz, block_size, v_dim)
    if out is None:
        out = torch.empty(bsz, h, v_dim, dtype=q.dtype, device=q.device)
    elif out.shape != (bsz, h, v_dim) or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {q.dtype} {(bsz, h, v_dim)} with contiguous last dim")
    if bsz == 0 or h == 0:
        return out
    if num_splits is None:
        cap = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(bsz, h, min(max_seq_len or cap, cap), _num_sms(q.device))
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits {num_splits} out of range")

    fp8 = check_fp8_cache(cache, q.dtype)
    block_n, num_warps, num_stages = decode_config(q.dtype, v_dim)
    if num_splits > 1:
        part_out = torch.empty(bsz, h, num_splits, v_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(bsz, h, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _mla_decode_kernel[(triton.cdiv(h, BLOCK_H), bsz, num_splits)](
        q, cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * _LOG2E * (kv_scale if fp8 else 1.0), kv_scale, num_splits,
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1), h,
        BLOCK_H=BLOCK_H, V_DIM=v_dim, ROPE_DIM=dk - v_dim, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=fp8,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _mla_split_reduce_kernel[(bsz, h)](
            part_out, part_lse, out, out.stride(0), out.stride(1), h, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), V_DIM=v_dim,
            num_warps=4,
        )
    return out

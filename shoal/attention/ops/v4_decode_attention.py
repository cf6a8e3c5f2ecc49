"""DeepSeek-V4's attention (shoal/layers/compressed_attention.py) in one Triton kernel: each
row's query token [H, D] over its sliding window's rows plus its compressed entries, read
straight from the paged caches. A row is a decode, or one token of a prefill chunk or verify
step (table_rows [R]: the row of the tables its request's are, so a chunk's tokens share one
table row instead of a copy each; without it row r reads table row r, as decodes do). Rows are
independent: a chunk's token reads what a decode at its position would, which is what the torch
path lets it see (its window up to itself, the entries of the groups complete at its position)
once the step's rows and closed entries are in the caches.

A row at position p reads, in one softmax with a sink logit per head (a logit with no value):
- the window rows of positions (p - window, p] that exist (>= 0), from the window's cache
  through its table (block table[p // bs], slot p % bs; a column past the table reads its
  last column, as PagedRows.read_decodes does);
- its compressed entries (one per complete group of `ratio` tokens: the (p + 1) // ratio
  first of them, capped at what its table holds): every one (HCA, or CSA whose tables hold no
  more than top-k entries), or the ones the indexer picked (CSA: indices [R, K] sorted best
  first, as torch.topk gives them, so a row's visible picks lead; a pick past the row's own
  entries is masked). Entry w lies in the block of its last token e = (w + 1) ratio - 1, in
  entry slot w - floor(e / bs) bs / ratio (PagedEntries._slots) of that block's page.
The keys are the values (one shared KV row per token: the whole head_dim, rope part
included); scores are q . k * scale, the softmax online in float32 (exp2 of log2-scaled
scores; the torch path's bf16 matmul rounds q . k to bf16 first, a step of 0.25 at logits of
32-64: the two differ by more than bf16's rounding where keys are large, and tests hold the
kernel to exact logits). The loops stop at each row's own counts, read on the device (no host
sync, launch shapes fixed by the batch and table width: CUDA-graph safe). Under
TRITON_INTERPRET=1 (q on the CPU) the half-dtype dots and roundings go through
interpreted_half.py, so the interpreter gives the GPU's bf16 results.

FP8 pages (kv_cache_dtype="fp8": PagedKeys.fp8, attention/fp8_rows.py) hold e4m3 bytes and a
float32 scale per block of each row: a key tile is loaded as FP8, converted to float32, times
its blocks' scales (loaded per column from the same rows' scale words), then rounded to q's
dtype, as the torch path's dequantization does; nothing else changes.

A program owns one row, BLOCK_H heads (the rows of the tensor-core products; every head
shares the keys, so one tile read serves them all) and one split of the row's keys: the
window and the entries are each cut into num_splits whole tiles, from the row's own counts.
With several splits each writes its partial output and log-sum-exp and a second kernel
combines them with the sink."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal.attention.ops.interpreted_half import half_dot, to_dtype
from shoal.attention.ops.key_splits import sm_count, split_count, split_range

# (v4_index_scores.py and the layers import these from here too)
from shoal.attention.ops.v4_paged_keys import (
    PagedKeys,
    check_pages,
    check_table_rows,
    key_operands,
    load_keys,
)

_LOG2E = 1.4426950408889634
_LOG2E_K = tl.constexpr(_LOG2E)  # (the kernels' copy)
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "-inf" for the running max: no inf - inf = nan
BLOCK_H = 16  # heads per program: the smallest tl.dot tile height
MAX_GRID_ROWS = 65535  # a launch's rows (the grid's second axis: CUDA's limit)
MIN_SPLIT_KEYS = 64  # a split shorter than a couple of key tiles costs more than it saves
MAX_SPLITS = 32
# what a row reads of its compressed entries
NO_ENTRIES, EVERY_ENTRY, PICKED_ENTRIES = 0, 1, 2


@dataclass(frozen=True)
class DecodeEntries:
    """A compressed layer's entries for the decode rows: their cache, one entry per `ratio`
    tokens, and the indexer's picks [R, K] (CSA, sorted best first) or None (every entry)."""

    pages: PagedKeys
    ratio: int
    picked: torch.Tensor | None = None


@triton.jit
def _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """One tile of keys (= values) k [BLOCK_N, D] into the running max, sum and output (the
    scores stay float32: no rounding to q's dtype)."""
    s = half_dot(q, tl.trans(k), DOT_PRECISION, INTERPRETED) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + half_dot(to_dtype(p, k.dtype, INTERPRETED), k, DOT_PRECISION,
                                          INTERPRETED)
    return m_new, l_i, acc



@triton.jit
def _window_pass(q, d, p, t, split, num_splits, window, win_ptr, win_tab_ptr, win_sc_ptr,
                 stride_wb, stride_ws, stride_wtr, stride_wtc, win_cols, stride_wsb, stride_wss,
                 win_sc0, m_i, l_i, acc, qk_scale, BLOCK_N: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
                 WIN_QBLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """This split's tiles of the row's window rows (table row t) into the running state: key
    j of the row's n_win is position p - n_win + 1 + j."""
    n_win = tl.maximum(tl.minimum(p + 1, window), 0)
    lo, hi = split_range(0, n_win, split, num_splits, BLOCK_N)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        valid = j < hi
        k_pos = p - n_win + 1 + j
        col = tl.minimum(k_pos // BLOCK_SIZE, win_cols - 1)
        block = tl.load(win_tab_ptr + t * stride_wtr + col * stride_wtc, mask=valid,
                        other=0).to(tl.int64)
        k = load_keys(win_ptr, win_sc_ptr, block, k_pos % BLOCK_SIZE, stride_wb, stride_ws,
                      stride_wsb, stride_wss, win_sc0, d, valid, WIN_QBLOCK, KV_FP8)
        k = to_dtype(k, q.dtype, INTERPRETED)
        m_i, l_i, acc = _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION,
                                     INTERPRETED)
    return m_i, l_i, acc


@triton.jit
def _entries_pass(q, d, p, r, t, split, num_splits, n_entries, n_picked, ent_ptr, ent_tab_ptr,
                  picked_ptr, ent_sc_ptr, stride_eb, stride_es, stride_etr, stride_etc, ent_cols,
                  stride_pk, stride_esb, stride_ess, ent_sc0, m_i, l_i, acc, qk_scale,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, RATIO: tl.constexpr,
                  ENTRIES: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
                  ENT_QBLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """This split's tiles of the row's compressed entries (every one, or its picks: ENTRIES
    EVERY_ENTRY / PICKED_ENTRIES) into the running state."""
    seen = tl.maximum((p + 1) // RATIO, 0)  # the row's complete groups
    if ENTRIES == 1:
        n_ent = tl.minimum(seen, n_entries)
    else:  # its picks that are its own come first (sorted by score, the others -inf)
        n_ent = tl.minimum(seen, n_picked)
    lo, hi = split_range(0, n_ent, split, num_splits, BLOCK_N)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        valid = j < hi
        if ENTRIES == 1:
            w = j
        else:
            w = tl.load(picked_ptr + r * stride_pk + j, mask=valid, other=0).to(tl.int64)
            valid = valid & (w < seen)
        col = tl.minimum(((w + 1) * RATIO - 1) // BLOCK_SIZE, ent_cols - 1)
        block = tl.load(ent_tab_ptr + t * stride_etr + col * stride_etc, mask=valid,
                        other=0).to(tl.int64)
        slot = w - (col * BLOCK_SIZE) // RATIO
        k = load_keys(ent_ptr, ent_sc_ptr, block, slot, stride_eb, stride_es, stride_esb,
                      stride_ess, ent_sc0, d, valid, ENT_QBLOCK, KV_FP8)
        k = to_dtype(k, q.dtype, INTERPRETED)
        m_i, l_i, acc = _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION,
                                     INTERPRETED)
    return m_i, l_i, acc


@triton.jit
def _store_with_sink(m_i, l_i, acc, r, heads, h_mask, d, sinks_ptr, out_ptr, stride_or,
                     stride_oh, INTERPRETED: tl.constexpr):
    """The row's output (one split: all its keys) with each head's sink in the softmax."""
    sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * _LOG2E_K
    m_f = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_f)
    denom = l_i * alpha + tl.exp2(sink - m_f)
    o = acc * (alpha / denom)[:, None]
    tl.store(out_ptr + r * stride_or + heads[:, None] * stride_oh + d[None, :],
             to_dtype(o, out_ptr.dtype.element_ty, INTERPRETED), mask=h_mask[:, None])


@triton.jit
def _store_split(m_i, l_i, acc, r, heads, h_mask, d, split, num_splits, num_heads,
                 part_out_ptr, part_lse_ptr, HEAD_DIM: tl.constexpr):
    """This split's partial output and log-sum-exp into the scratch part_lse [R, H, S],
    part_out [R, H, S, D]; an empty split writes only its -inf lse and the combine skips its
    output row."""
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    prow = (r * num_heads + heads) * num_splits + split
    tl.store(part_lse_ptr + prow, lse, mask=h_mask)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(part_out_ptr + prow[:, None] * HEAD_DIM + d[None, :], o,
             mask=(h_mask & (l_i > 0))[:, None])


@triton.jit(do_not_specialize=["num_splits", "window", "n_entries", "n_picked"])
def _v4_decode_kernel(
    q_ptr, pos_ptr, sinks_ptr, win_ptr, win_tab_ptr, ent_ptr, ent_tab_ptr, picked_ptr,
    win_sc_ptr, ent_sc_ptr, out_ptr, part_out_ptr, part_lse_ptr, table_rows_ptr,
    qk_scale, num_splits, num_heads, window, n_entries, n_picked,
    stride_qr, stride_qh, stride_wb, stride_ws, stride_wtr, stride_wtc, win_cols,
    stride_eb, stride_es, stride_etr, stride_etc, ent_cols, stride_pk, stride_or, stride_oh,
    stride_wsb, stride_wss, win_sc0, stride_esb, stride_ess, ent_sc0,
    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, RATIO: tl.constexpr, ENTRIES: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    WIN_QBLOCK: tl.constexpr, ENT_QBLOCK: tl.constexpr, TABLE_ROWS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # head blocks vary fastest: the programs reading the same key tiles run side by side
    hb = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    p = tl.load(pos_ptr + r).to(tl.int64)
    if TABLE_ROWS:  # (a chunk's tokens: their request's row of the tables)
        t = tl.load(table_rows_ptr + r).to(tl.int64)
    else:
        t = r
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + r * stride_qr + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    m_i, l_i, acc = _window_pass(
        q, d, p, t, split, num_splits, window, win_ptr, win_tab_ptr, win_sc_ptr, stride_wb,
        stride_ws, stride_wtr, stride_wtc, win_cols, stride_wsb, stride_wss, win_sc0,
        m_i, l_i, acc, qk_scale, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, KV_FP8, WIN_QBLOCK,
        INTERPRETED)
    if ENTRIES != 0:
        m_i, l_i, acc = _entries_pass(
            q, d, p, r, t, split, num_splits, n_entries, n_picked, ent_ptr, ent_tab_ptr,
            picked_ptr, ent_sc_ptr, stride_eb, stride_es, stride_etr, stride_etc, ent_cols,
            stride_pk, stride_esb, stride_ess, ent_sc0, m_i, l_i, acc, qk_scale, BLOCK_N,
            BLOCK_SIZE, RATIO, ENTRIES, DOT_PRECISION, KV_FP8, ENT_QBLOCK, INTERPRETED)
    if not SPLIT:
        _store_with_sink(m_i, l_i, acc, r, heads, h_mask, d, sinks_ptr, out_ptr, stride_or,
                         stride_oh, INTERPRETED)
    else:
        _store_split(m_i, l_i, acc, r, heads, h_mask, d, split, num_splits, num_heads,
                     part_out_ptr, part_lse_ptr, HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, num_heads, num_splits,
                    stride_or, stride_oh, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s_idx = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    row0 = (r * num_heads + h) * num_splits
    lse = tl.load(part_lse_ptr + row0 + s_idx, mask=s_idx < num_splits, other=float("-inf"))
    sink = tl.load(sinks_ptr + h).to(tl.float32) * _LOG2E_K
    m = tl.maximum(tl.max(lse, 0), sink)  # the sink is finite: so is m
    denom = tl.sum(tl.exp2(lse - m), 0) + tl.exp2(sink - m)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s in range(num_splits):  # one split's row at a time: [S, D] may not fit registers
        lse_s = tl.load(part_lse_ptr + row0 + s)
        o = tl.load(part_out_ptr + (row0 + s) * HEAD_DIM + d,
                    mask=d < tl.where(lse_s > float("-inf"), HEAD_DIM, 0), other=0.0)
        acc += o * tl.exp2(lse_s - m)
    tl.store(out_ptr + r * stride_or + h * stride_oh + d,
             to_dtype(acc / denom, out_ptr.dtype.element_ty, INTERPRETED))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return sm_count(device, 132)  # (the interpreter: an H100's)


def choose_num_splits(rows: int, num_heads: int, max_keys: int, num_sms: int = 132) -> int:
    """Key splits per (row, block of BLOCK_H heads), a power of two: enough programs for two
    waves, but none shorter than MIN_SPLIT_KEYS of the most keys a row may read (window + the
    entries its tables hold or top-k). From shapes only: a CUDA graph's stays fixed."""
    return split_count(rows * triton.cdiv(num_heads, BLOCK_H), max_keys, MIN_SPLIT_KEYS,
                       MAX_SPLITS, num_sms)


def _check(q: torch.Tensor, positions: torch.Tensor, sinks: torch.Tensor, window: PagedKeys,
           entries: DecodeEntries | None, table_rows: torch.Tensor | None) -> None:
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be [R, H, D] with a contiguous last dim, got "
                         f"{tuple(q.shape)} strides {q.stride()}")
    rows, heads, dim = q.shape
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"head_dim {dim} must be a power of two >= 16")
    if tuple(positions.shape) != (rows,):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected ({rows},)")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}, expected ({heads},)")
    check_table_rows(table_rows, rows)
    caches = [("window", window)] + ([("entries", entries.pages)] if entries else [])
    for name, paged in caches:
        check_pages(name, paged, rows if table_rows is None else 1, dim)
    if entries is not None:
        if entries.ratio < 1:
            raise ValueError(f"entries ratio must be >= 1, got {entries.ratio}")
        picked = entries.picked
        if picked is not None and (picked.dim() != 2 or picked.shape[0] < rows
                                   or picked.stride(1) != 1):
            raise ValueError(f"picked must be [>= {rows}, K] with contiguous rows, got "
                             f"{tuple(picked.shape)}")



def launch(q: torch.Tensor, positions: torch.Tensor, sinks: torch.Tensor, scale: float,
           window: PagedKeys, window_len: int, block_size: int,
           entries: DecodeEntries | None = None, *, num_splits: int | None = None,
           block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
           table_rows: torch.Tensor | None = None, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """v4_decode_attention with its tiling chosen (for timing them); out: where to write
    (like q, contiguous), else a new tensor."""
    _check(q, positions, sinks, window, entries, table_rows)
    rows, heads, dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be like q {tuple(q.shape)} {q.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if rows > MAX_GRID_ROWS:  # (a long prefill chunk's tokens: the grid's rows axis is short)
        for a in range(0, rows, MAX_GRID_ROWS):
            b = min(a + MAX_GRID_ROWS, rows)
            win, ent, part_rows = _rows_of(a, b, window, entries, table_rows)
            launch(q[a:b], positions[a:b], sinks, scale, win, window_len, block_size, ent,
                   num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                   num_stages=num_stages, table_rows=part_rows, out=out[a:b])
        return out
    if rows == 0 or heads == 0:
        return out
    mode, n_entries, n_picked, ratio = NO_ENTRIES, 0, 0, 1
    ent, picked = window, positions  # (unread when there are no entries / picks)
    win = key_operands("window", window, 0, dim, q.dtype)
    ents = win
    if entries is not None:
        ent, ratio = entries.pages, entries.ratio
        ents = key_operands("entries", ent, 0, dim, q.dtype)
        if ents.fp8 != win.fp8:
            raise ValueError("the window's and the entries' pages must both be FP8 or neither")
        n_entries = ent.tables.shape[1] * block_size // ratio
        mode = EVERY_ENTRY
        if entries.picked is not None:
            mode, picked, n_picked = PICKED_ENTRIES, entries.picked, entries.picked.shape[1]
    max_keys = window_len + (n_picked if mode == PICKED_ENTRIES else n_entries)
    if num_splits is None:
        num_splits = choose_num_splits(rows, heads, max_keys, _num_sms(q.device))
    if block_n is None:
        block_n = 16 if q.dtype == torch.float32 or dim > 512 else 32
    split = num_splits > 1
    interpreted = q.device.type == "cpu"  # (TRITON_INTERPRET=1; meta tensors: compiled)
    part_out = part_lse = out  # (unused without splits)
    if split:
        part_out = torch.empty(rows, heads, num_splits, dim, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=q.device)
    _v4_decode_kernel[(triton.cdiv(heads, BLOCK_H), rows, num_splits)](
        q, positions, sinks, win.values, window.tables, ents.values, ent.tables, picked,
        win.scales, ents.scales, out, part_out, part_lse,
        positions if table_rows is None else table_rows,  # (unread without table rows)
        scale * _LOG2E, num_splits, heads, window_len, n_entries, n_picked,
        q.stride(0), q.stride(1), win.values.stride(0), win.values.stride(1),
        window.tables.stride(0), window.tables.stride(1), window.tables.shape[1],
        ents.values.stride(0), ents.values.stride(1), ent.tables.stride(0),
        ent.tables.stride(1), ent.tables.shape[1],
        picked.stride(0), out.stride(0), out.stride(1),
        win.scales.stride(0), win.scales.stride(1), win.first_scale,
        ents.scales.stride(0), ents.scales.stride(1), ents.first_scale,
        BLOCK_H=BLOCK_H, HEAD_DIM=dim, BLOCK_N=block_n, BLOCK_SIZE=block_size, RATIO=ratio,
        ENTRIES=mode, SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=win.fp8,
        WIN_QBLOCK=win.block, ENT_QBLOCK=ents.block, TABLE_ROWS=table_rows is not None,
        INTERPRETED=interpreted, num_warps=num_warps, num_stages=num_stages)
    if split:
        _combine_kernel[(rows, heads)](
            part_out, part_lse, sinks, out, heads, num_splits, out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=dim,
            INTERPRETED=interpreted, num_warps=4)
    return out


def _rows_of(a: int, b: int, window: PagedKeys, entries: DecodeEntries | None,
             table_rows: torch.Tensor | None
             ) -> tuple[PagedKeys, DecodeEntries | None, torch.Tensor | None]:
    """The window's and the entries' caches and the table rows of launch's rows [a, b): each
    row's tables (all of them where table_rows names each row's) and picks."""
    def cut(paged: PagedKeys) -> PagedKeys:
        if table_rows is not None:
            return paged
        return PagedKeys(paged.pages, paged.tables[a:b], paged.fp8)
    part = None
    if entries is not None:
        picked = None if entries.picked is None else entries.picked[a:b]
        part = DecodeEntries(cut(entries.pages), entries.ratio, picked)
    return cut(window), part, None if table_rows is None else table_rows[a:b]


def v4_decode_attention(q: torch.Tensor, positions: torch.Tensor, sinks: torch.Tensor,
                        scale: float, window: PagedKeys, window_len: int, block_size: int,
                        entries: DecodeEntries | None = None,
                        num_splits: int | None = None,
                        table_rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [R, H, D] (one query token a row, at positions [R]; D a power of two, contiguous),
    sinks [H] (a logit per head), the window's cache and tables (window_len tokens), the
    entries' (None: a sliding layer, or tables holding no entry) -> [R, H, D] in q's dtype:
    softmax over [q . k * scale for every key, sink] of the keys as values. num_splits None
    picks one from the shapes. table_rows [R]: the row of both caches' tables each row reads
    (None: row r reads row r, the tables then [>= R, N])."""
    return launch(q, positions, sinks, scale, window, window_len, block_size, entries,
                  num_splits=num_splits, table_rows=table_rows)

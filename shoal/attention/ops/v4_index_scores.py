"""DeepSeek-V4's lightning-indexer scores per row (shoal/layers/compressed_indexer.py) in one
Triton kernel, reading the index keys straight from the paged entries' cache. A row is a
decode or one token of a prefill chunk or verify step (table_rows [R]: its request's row of
the tables, as in v4_decode_attention.py; without it row r reads table row r).

Row r (one query token at position p, n_heads queries [Hi, Di] float32 and head weights
[Hi]) scores entry w as scale * sum_h weights_h * relu(q_h . key_w), for the entries it has
seen (w < (p + 1) // ratio, capped at what its tables hold, n_entries); the others get -inf,
so torch.topk over the fixed width [R, n_entries] puts a row's own entries first. Entry w's
index key sits in columns [key_column, key_column + Di) of its entry slot, in the page of the
block of its last token e = (w + 1) ratio - 1, slot w - floor(e / bs) bs / ratio
(PagedEntries._slots).

A program owns one row and BLOCK_N entries; one past the row's entries only writes -inf.
Launch shapes follow the batch and table width, the row's length is read on the device:
CUDA-graph safe. The products run in float32 (ieee) as the torch path's matmul does: the
top-k is a hard choice, a tf32 rounding would flip near ties. Where q comes in the pages'
half dtype (bf16/fp16: the model's queries are rounded to it before the indexer widens them,
so the caller narrows them back losslessly), the dot runs on tensor cores in that dtype with
float32 sums: a product of two half values is exact in float32, so only the order of the
sums differs from the torch path's. Under TRITON_INTERPRET=1 the half dots go through
interpreted_half.half_dot (the interpreter's own bf16 dot is wrong), as the decode kernels'.

FP8 pages (kv_cache_dtype="fp8") hold the keys as e4m3 with a float32 scale per block of
values (PagedKeys.fp8). With half queries they run on tensor cores too: every e4m3 value is
exact in bf16 and fp16, so the tile is converted unscaled, its products with q are exact in
float32, and a block's scale multiplies the float32 sum of its products. Where one block
covers the whole index key (V3.2's keys, 128 values a scale; V4's indexer segment, blocks of
gcd(index_head_dim, 128): one a key up to 128 dims, V4's), that is one dot and one multiply per key
column: q . k = fl(fl_sum(q_d k8_d) * scale), where the float32 path gives
fl_sum(fl(q_d fl(k8_d * scale))). Both approximate the same exact sum (of the exact
k8 * scale); the products are now exact (the float32 path rounds each twice) and the scale
adds one rounding to the sum, whose order is the tensor core's: the two differ within
float32's sum error (tests/attention/test_fp8_index_scores.py bounds it), not bit for bit.
Keys of several blocks (blocks of 16 or more values, a power of two) take one dot per block,
each times its block's scale, added in block order (deterministic, the same in a CUDA graph);
blocks under 16 values (below a tensor-core dot's depth) or not a power of two, and float32
queries, take the float32 path: loaded as the decode attention loads them (load_keys: each
value times its scale, in float32)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.attention.ops.interpreted_half import half_dot
from shoal.attention.ops.v4_decode_attention import (
    PagedKeys,
    check_pages,
    check_table_rows,
    key_operands,
    load_keys,
)
from shoal.attention.ops.v4_paged_keys import KeyOperands

HALF_DTYPES = (torch.bfloat16, torch.float16)
MIN_DOT_DEPTH = 16  # the fewest columns (K) of a tensor-core dot
FLOAT32_COLUMNS = 16  # the float32 path's columns a step (see the kernel's note)


@triton.jit(do_not_specialize=["n_entries"])
def _index_scores_kernel(
    q_ptr, w_ptr, pos_ptr, ent_ptr, tab_ptr, sc_ptr, out_ptr, table_rows_ptr,
    scale, n_heads, n_entries,
    stride_qr, stride_qh, stride_wr, stride_eb, stride_es, stride_tr, stride_tc, ent_cols,
    stride_or, stride_sb, stride_ss, sc0,
    BLOCK_HI: tl.constexpr, INDEX_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, RATIO: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr, QBLOCK: tl.constexpr, HALF: tl.constexpr,
    INTERPRETED: tl.constexpr, TABLE_ROWS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    w0 = tl.program_id(1) * BLOCK_N
    w = w0 + tl.arange(0, BLOCK_N)
    in_table = w < n_entries
    p = tl.load(pos_ptr + r).to(tl.int64)
    seen = tl.minimum(tl.maximum((p + 1) // RATIO, 0), n_entries)
    out = out_ptr + r * stride_or + w
    if w0 < seen:
        valid = w < seen
        col = tl.minimum(((w + 1) * RATIO - 1) // BLOCK_SIZE, ent_cols - 1)
        if TABLE_ROWS:
            t = tl.load(table_rows_ptr + r).to(tl.int64)
        else:
            t = r
        block = tl.load(tab_ptr + t * stride_tr + col * stride_tc, mask=valid,
                        other=0).to(tl.int64)
        slot = w - (col * BLOCK_SIZE) // RATIO
        heads = tl.arange(0, BLOCK_HI)
        h_mask = heads < n_heads
        # the products BLOCK_D columns at a time: a float32 (ieee) dot runs on FMAs with its
        # operands' whole K in registers, and all 128 at once spill kilobytes a thread on
        # sm_90 (ptxas: 5 KiB of stack at block_n 32, 4 warps; 16 at a time: 80 registers);
        # HALF: a tensor-core dot over the whole K (BLOCK_D = INDEX_DIM), or over each scale
        # block of FP8 keys (BLOCK_D = QBLOCK), the blocks added in order
        s = tl.zeros([BLOCK_HI, BLOCK_N], tl.float32)
        for d0 in tl.static_range(0, INDEX_DIM, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            q = tl.load(q_ptr + r * stride_qr + heads[:, None] * stride_qh + d[None, :],
                        mask=h_mask[:, None], other=0.0)
            if HALF:
                # as stored (FP8 unscaled: e4m3 converts to q's half dtype exactly)
                keys = load_keys(ent_ptr, sc_ptr, block, slot, stride_eb,
                                 stride_es, stride_sb, stride_ss, sc0, d, valid, QBLOCK,
                                 False).to(q.dtype)
                part = half_dot(q, tl.trans(keys), DOT_PRECISION, INTERPRETED)  # [Hi, BLOCK_N]
                if KV_FP8:  # the scale of this block of each key: one per column
                    sc = tl.load(sc_ptr + block * stride_sb + slot * stride_ss + sc0
                                 + d0 // QBLOCK, mask=valid, other=0.0)
                    part = part * sc[None, :]
                s += part
            else:
                keys = load_keys(ent_ptr, sc_ptr, block, slot, stride_eb,
                                 stride_es, stride_sb, stride_ss, sc0, d, valid, QBLOCK,
                                 KV_FP8)
                s = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), s,
                           input_precision=DOT_PRECISION)
        weights = tl.load(w_ptr + r * stride_wr + heads, mask=h_mask, other=0.0)
        score = tl.sum(tl.maximum(s, 0.0) * weights.to(tl.float32)[:, None], 0) * scale
        tl.store(out, tl.where(valid, score, float("-inf")), mask=in_table)
    else:
        tl.store(out, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=in_table)


def _check(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
           entries: PagedKeys, key_column: int, table_rows: torch.Tensor | None) -> None:
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be [R, Hi, Di] with a contiguous last dim, got "
                         f"{tuple(q.shape)} strides {q.stride()}")
    rows, heads, dim = q.shape
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"index_head_dim {dim} must be a power of two >= 16")
    if tuple(weights.shape) != (rows, heads) or weights.stride(1) != 1:
        raise ValueError(f"weights has shape {tuple(weights.shape)}, expected contiguous "
                         f"({rows}, {heads})")
    if tuple(positions.shape) != (rows,):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected ({rows},)")
    check_table_rows(table_rows, rows)
    check_pages("entries", entries, rows if table_rows is None else 1, dim, key_column)


def tensor_core_columns(q_dtype: torch.dtype, keys: KeyOperands, dim: int) -> int | None:
    """The key columns of each tensor-core dot of q (q_dtype) with keys `dim` wide, or None
    where the products take the float32 path: float32 queries, half pages of another dtype,
    FP8 blocks under MIN_DOT_DEPTH values or not a power of two (a dot's depth must be)."""
    if q_dtype not in HALF_DTYPES:
        return None
    if not keys.fp8:
        return dim if keys.values.dtype == q_dtype else None
    if keys.block >= dim:  # (one scale a key: the blocks start at the key's first column)
        return dim
    if keys.block >= MIN_DOT_DEPTH and keys.block & (keys.block - 1) == 0:
        return keys.block  # (a power of two under dim, itself one: the blocks tile the key)
    return None


def launch(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, entries: PagedKeys,
           key_column: int, ratio: int, block_size: int, scale: float, *, block_n: int = 32,
           num_warps: int = 4, table_rows: torch.Tensor | None = None) -> torch.Tensor:
    """v4_index_scores with its tiling chosen (for timing them)."""
    _check(q, weights, positions, entries, key_column, table_rows)
    rows, heads, dim = q.shape
    n_entries = entries.tables.shape[1] * block_size // ratio
    out = torch.empty(rows, n_entries, dtype=torch.float32, device=q.device)
    if rows == 0 or n_entries == 0:
        return out
    keys = key_operands("entries", entries, key_column, dim, q.dtype)
    columns = tensor_core_columns(q.dtype, keys, dim)
    half = columns is not None
    # the keys' column folded into the pointer: Triton then knows a row's keys start 16-byte
    # aligned (FP8 rows are padded to 16 bytes) and loads them in vectors
    key_values = keys.values[..., key_column:]
    _index_scores_kernel[(rows, triton.cdiv(n_entries, block_n))](
        q, weights, positions, key_values, entries.tables, keys.scales, out,
        positions if table_rows is None else table_rows,  # (unread without table rows)
        scale, heads, n_entries,
        q.stride(0), q.stride(1), weights.stride(0), keys.values.stride(0),
        keys.values.stride(1), entries.tables.stride(0), entries.tables.stride(1),
        entries.tables.shape[1], out.stride(0),
        keys.scales.stride(0), keys.scales.stride(1), keys.first_scale,
        BLOCK_HI=max(16, triton.next_power_of_2(heads)), INDEX_DIM=dim, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, RATIO=ratio, DOT_PRECISION="ieee",
        BLOCK_D=columns or FLOAT32_COLUMNS, KV_FP8=keys.fp8, QBLOCK=keys.block, HALF=half,
        INTERPRETED=q.device.type == "cpu", TABLE_ROWS=table_rows is not None,
        num_warps=num_warps)
    return out


def v4_index_scores(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                    entries: PagedKeys, key_column: int, ratio: int, block_size: int,
                    scale: float, table_rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [R, Hi, Di] (float32, or bf16/fp16: tensor cores over pages of its dtype or FP8
    pages, whose blocks allow: tensor_core_columns) and weights [R, Hi]
    (the indexer's, float32), positions [R], the entries' pages (index keys at key_column of
    each entry slot) and tables [R, N] (or any rows, with table_rows [R] saying each row's)
    -> scores [R, N * block_size // ratio] float32, -inf past each row's own entries."""
    return launch(q, weights, positions, entries, key_column, ratio, block_size, scale,
                  table_rows=table_rows)

"""The segmented path of the Triton LoRA op (lora_triton.py, the role of punica's SGMV): the
step's tokens grouped by adapter slot into segments of at most BLOCK_T tokens of one slot,
each adapter's A and B read once per segment and multiplied on the tensor cores (tl.dot),
for prefills and wide decode batches.

Segments: the tokens in slot order (slot 0's first, each slot's in token order), cut into
blocks of BLOCK_T; segment p is the p-th such block. A slot of c tokens makes cdiv(c,
BLOCK_T) segments, so there are at most T // BLOCK_T + min(S, T): the grid is sized from
the shapes alone, and a program whose p is past the step's segments writes "no segment"
and exits (CUDA graphs: no host sync, nothing read from the slots decides a launch).

The shrink plans its own segment, with no kernel of its own and no sort: every program
counts the tokens of each slot (tl.histogram over chunks of token_slots), finds its slot
and block from the counts' prefix sums, then, in a second pass that stops once its block is
complete, stores the block's token indices (rank within the slot - first rank) into a
scratch row of its own, read back after a CTA barrier. The program of row block 0 and
split 0 also writes the segment table (slot, length, tokens) that the expand reads.

- shrink: float32 partials h[split, p*BLOCK_T + j, rows] = x[tokens] [BLOCK_T, K-share] @
  A[slot][rows, K-share]^T; split-K over the input features when the segments alone would
  not fill the GPU (SHRINK_TARGET programs); tl.dot over a software-pipelined K loop.
- expand: y[tokens, cols] += round(h) @ B[slot][cols]^T. A program takes one segment and a
  run of column blocks: it sums h's partials once (in split order: deterministic, no
  atomics), rounds h to x's dtype, then per block of columns one tl.dot against B laid out
  block-diagonally over the sub-projections (a column of sub i multiplies sub i's R
  columns of h only; the other entries are masked, never loaded); the delta added to y in
  float32 and rounded once.

Slot values outside [0, S) count as no adapter here (the histogram's bin 0): skipped, not
read out of bounds. Up to MAX_SLOTS slots (the histogram's bins) and ranks up to 64 (see
supports())."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.attention.ops.interpreted_half import to_dtype

MAX_SLOTS = 64  # the histogram's bins; more slots (MoE experts x adapters) take split-K
MAX_K_DIM = 256  # h's columns in the expand (sub-projections x padded rank), at most
SHRINK_TARGET = 264  # shrink programs to aim for: two per multiprocessor of an H100
EXPAND_TARGET = 528  # expand programs to aim for: four per multiprocessor
MAX_SPLIT = 16
SCAN_CHUNK = 1024  # tokens per iteration of the planning passes over token_slots
MIN_CHUNK = 256  # (tl.histogram's input: at least one element per thread of 8 warps)
BLOCK_K = 64
B_TILE = 8192  # elements of a B tile [SUB_PAD * R_PAD, BLOCK_N] of the expand


@triton.jit
def _find_segment(slots_ptr, stride_slot, n_tokens, n_slots, p, N_BINS: tl.constexpr,
                  BLOCK_T: tl.constexpr, CHUNK: tl.constexpr):
    """(slot, first, length): segment p holds the slot's tokens of ranks [first, first +
    length) among the slot's tokens in token order; slot -1 when the step has fewer
    segments. Bin b of the histogram counts slot b - 1; bin 0 the tokens of no adapter and
    slots outside [0, n_slots) (skipped rather than read out of bounds)."""
    bins = tl.arange(0, N_BINS)
    counts = tl.zeros((N_BINS,), dtype=tl.int32)
    for c0 in tl.range(0, n_tokens, CHUNK, num_stages=2):  # (loads of the next chunk early)
        t = c0 + tl.arange(0, CHUNK)
        s = tl.load(slots_ptr + t.to(tl.int64) * stride_slot, mask=t < n_tokens, other=-1)
        counts += tl.histogram(tl.where((s >= 0) & (s < n_slots), s + 1, 0).to(tl.int32),
                               N_BINS)
    blocks = tl.where(bins > 0, (counts + BLOCK_T - 1) // BLOCK_T, 0)
    ends = tl.cumsum(blocks, axis=0)
    b = tl.sum((ends <= p).to(tl.int32), axis=0)  # N_BINS when p is past every segment
    first_block = tl.sum(tl.where(bins < b, blocks, 0), axis=0)
    count = tl.sum(tl.where(bins == b, counts, 0), axis=0)
    first = (p - first_block) * BLOCK_T
    length = tl.minimum(count - first, BLOCK_T)
    return tl.where(b < N_BINS, b - 1, -1), first, length


@triton.jit
def _gather_segment(slots_ptr, stride_slot, n_tokens, slot, first, length, scratch_ptr,
                    BLOCK_T: tl.constexpr, CHUNK: tl.constexpr):
    """The segment's token indices [BLOCK_T] (-1 past its length), through scratch_ptr (this
    program's own row): each token of the slot with rank in [first, first + length) is
    stored at rank - first."""
    seen = tl.zeros((), dtype=tl.int32)  # the slot's tokens before chunk c0
    c0 = tl.zeros((), dtype=tl.int32)
    while (c0 < n_tokens) & (seen < first + length):
        t = c0 + tl.arange(0, CHUNK)
        s = tl.load(slots_ptr + t.to(tl.int64) * stride_slot, mask=t < n_tokens, other=-1)
        hit = (s == slot).to(tl.int32)
        rank = seen + tl.cumsum(hit, axis=0) - 1
        mine = (hit > 0) & (rank >= first) & (rank < first + length)
        tl.store(scratch_ptr + (rank - first), t, mask=mine)
        seen += tl.sum(hit, axis=0)
        c0 += CHUNK
    tl.debug_barrier()  # the stores above, by any thread of the program, are visible below
    j = tl.arange(0, BLOCK_T)
    return tl.load(scratch_ptr + j, mask=j < length, other=-1)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, table_ptr, scratch_ptr, slots_ptr, n_tokens, n_slots,
                   in_features, n_rows, k_per_split, stride_xt, stride_as, stride_ar,
                   stride_hs, stride_ht, stride_slot, N_BINS: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   SCAN_CHUNK: tl.constexpr, PRECISION: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    p = tl.program_id(0)
    rb, split = tl.program_id(1), tl.program_id(2)
    writer = (rb == 0) & (split == 0)  # the program that writes segment p's table row
    slot, first, length = _find_segment(slots_ptr, stride_slot, n_tokens, n_slots, p, N_BINS,
                                        BLOCK_T, SCAN_CHUNK)
    row = table_ptr + p.to(tl.int64) * (BLOCK_T + 16)  # [slot, length, ..., tokens from 16]
    tl.store(row, slot, mask=writer)
    if slot < 0:
        return
    mine = (p.to(tl.int64) * tl.num_programs(1) * tl.num_programs(2)
            + rb * tl.num_programs(2) + split) * BLOCK_T
    tok = _gather_segment(slots_ptr, stride_slot, n_tokens, slot, first, length,
                          scratch_ptr + mine, BLOCK_T, SCAN_CHUNK)
    j = tl.arange(0, BLOCK_T)
    if writer:
        tl.store(row + 1, length)
        tl.store(row + 16 + j, tok)
    valid = tok >= 0
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + rows[:, None].to(tl.int64) * stride_ar
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    k_end = tl.minimum((split + 1) * k_per_split, in_features)
    for k0 in range(split * k_per_split, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        xt = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if INTERPRETED:
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)
    h_rows = h_ptr + split * stride_hs + (p * BLOCK_T + j).to(tl.int64)[:, None] * stride_ht
    tl.store(h_rows + rows[None, :], acc, mask=valid[:, None] & row_mask[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, table_ptr, out_features, rank, off1, off2, off3,
                   stride_hs, stride_ht, stride_bs, stride_bo, stride_yt, split_k,
                   blocks_per_program, N_SUB: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_N: tl.constexpr, R_PAD: tl.constexpr, SUB_PAD: tl.constexpr,
                   UNROLL: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Segment p's tokens, blocks_per_program blocks of output rows from program_id(1)'s
    first: h (all sub-projections, [BLOCK_T, SUB_PAD * R_PAD], sub i in columns i*R_PAD..)
    summed once, then one tl.dot per block with B's rows laid out block-diagonally (a row of
    sub i reads only sub i's columns; the masked-out ones are never loaded)."""
    p = tl.program_id(0)
    row = table_ptr + p.to(tl.int64) * (BLOCK_T + 16)
    slot = tl.load(row).to(tl.int64)
    if slot < 0:
        return
    j = tl.arange(0, BLOCK_T)
    length = tl.load(row + 1)
    tok = tl.load(row + 16 + j, mask=j < length, other=-1)
    valid = tok >= 0
    k = tl.arange(0, SUB_PAD * R_PAD)
    k_sub, k_r = k // R_PAD, k % R_PAD
    k_mask = (k_sub < N_SUB) & (k_r < rank)
    h_tile = h_ptr + (p * BLOCK_T + j).to(tl.int64)[:, None] * stride_ht \
        + (k_sub * rank + k_r)[None, :]
    h = tl.zeros((BLOCK_T, SUB_PAD * R_PAD), dtype=tl.float32)
    for s0 in range(0, split_k, UNROLL):  # in split order; UNROLL loads in flight at once
        for u in tl.static_range(UNROLL):
            n_s = tl.where(s0 + u < split_k, length, 0)  # (no rows past the splits)
            h += tl.load(h_tile + (s0 + u) * stride_hs,
                         mask=(j < n_s)[:, None] & k_mask[None, :], other=0.0)
    h = to_dtype(h, y_ptr.dtype.element_ty, INTERPRETED)  # rounded to x's dtype
    if INTERPRETED:
        h = h.to(tl.float32)
    b_slot = b_ptr + slot * stride_bs + k_r[:, None]
    y_rows = y_ptr + tok.to(tl.int64)[:, None] * stride_yt
    n_first = tl.program_id(1) * blocks_per_program * BLOCK_N
    n_end = tl.minimum(n_first + blocks_per_program * BLOCK_N, out_features)
    for n0 in range(n_first, n_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_mask = cols < n_end
        sub = (cols >= off1).to(tl.int32) + (cols >= off2).to(tl.int32) \
            + (cols >= off3).to(tl.int32)
        bt = tl.load(b_slot + cols[None, :].to(tl.int64) * stride_bo,
                     mask=k_mask[:, None] & col_mask[None, :] & (k_sub[:, None] == sub[None, :]),
                     other=0.0)
        if INTERPRETED:
            bt = bt.to(tl.float32)
        delta = tl.dot(h, bt, input_precision=PRECISION)
        y_mask = valid[:, None] & col_mask[None, :]
        y = tl.load(y_rows + cols[None, :], mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y_rows + cols[None, :], to_dtype(y + delta, y_ptr.dtype.element_ty, INTERPRETED),
                 mask=y_mask)


def supports(n_slots: int, n_sub: int, rank: int) -> bool:
    """Whether these buffers fit the kernels' tiles: at most MAX_SLOTS slots (histogram
    bins) and a [BLOCK_T, sub-projections x padded rank] h of at most MAX_K_DIM columns
    (rank 64 for q|k|v; larger ranks would spill registers: the split-K path takes them)."""
    k_dim = triton.next_power_of_2(n_sub) * max(16, triton.next_power_of_2(rank))
    return n_slots <= MAX_SLOTS and k_dim <= MAX_K_DIM


@dataclass(frozen=True)
class Plan:
    """A launch's sizes, from the shapes alone (CUDA graphs)."""

    block_t: int  # tokens of a segment, at most
    segments: int  # an upper bound on the step's segments: the grid's first axis
    block_r: int  # rank rows of a shrink program
    row_blocks: int
    splits: int  # shares of the input features (split-K of the shrink)
    k_per_split: int
    n_bins: int  # of the slot histogram: one per slot and one for no adapter
    scan_chunk: int
    r_pad: int  # h's columns of one sub-projection in the expand (>= 16: tl.dot's K)
    sub_pad: int
    block_n: int  # output rows of one tl.dot of the expand
    groups: int  # expand programs per segment, each over blocks_per_program blocks of rows
    blocks_per_program: int
    expand_warps: int


@functools.lru_cache(maxsize=256)
def plan(n_tokens: int, n_slots: int, n_sub: int, rank: int, in_features: int,
         out_features: int) -> Plan:
    r_pad, sub_pad = max(16, triton.next_power_of_2(rank)), triton.next_power_of_2(n_sub)
    k_dim = sub_pad * r_pad  # the expand's h tile [BLOCK_T, k_dim] stays within 4096
    block_t = min(16 if n_tokens < 512 else 32 if n_tokens < 1024 else 64,
                  max(16, 4096 // k_dim))
    segments = n_tokens // block_t + min(n_slots, n_tokens)
    n_rows = n_sub * rank
    block_r = max(16, min(triton.next_power_of_2(n_rows), 64))
    row_blocks = triton.cdiv(n_rows, block_r)
    k_blocks = triton.cdiv(in_features, BLOCK_K)
    splits = max(1, min(triton.cdiv(SHRINK_TARGET, segments * row_blocks), k_blocks,
                        MAX_SPLIT))
    k_per_split = triton.cdiv(k_blocks, splits) * BLOCK_K
    # ~16 elements of the [BLOCK_T, BLOCK_N] tiles per thread (4 or 8 warps): no spills
    block_n = max(16, min(triton.next_power_of_2(out_features), 128, 4096 // block_t,
                          B_TILE // k_dim))
    n_blocks = triton.cdiv(out_features, block_n)
    per = triton.cdiv(n_blocks, max(1, min(triton.cdiv(EXPAND_TARGET, segments), n_blocks)))
    return Plan(block_t=block_t, segments=segments, block_r=block_r, row_blocks=row_blocks,
                splits=triton.cdiv(in_features, k_per_split), k_per_split=k_per_split,
                n_bins=triton.next_power_of_2(n_slots + 1),
                scan_chunk=max(MIN_CHUNK, min(triton.next_power_of_2(n_tokens), SCAN_CHUNK)),
                r_pad=r_pad, sub_pad=sub_pad, block_n=block_n,
                groups=triton.cdiv(n_blocks, per), blocks_per_program=per,
                expand_warps=8 if block_t * block_n >= 4096 or k_dim >= 128 else 4)


def add_lora_segmented(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor,
                       starts: list[int], n_sub: int, rank: int) -> None:
    """In place, arguments checked by lora_triton.add_lora (shapes that supports()
    takes); starts: the first rows of sub-projections 1..3 (out where there is none)."""
    n_tokens, out = y.shape
    n_rows, in_features = n_sub * rank, x.shape[1]
    c = plan(n_tokens, a.shape[0], n_sub, rank, in_features, out)
    bt, segs, splits = c.block_t, c.segments, c.splits
    # One workspace: the partials (float32), then the segment table and the shrink programs'
    # scratch rows (int32, same element size).
    n_h = splits * segs * bt * n_rows
    n_table = segs * (bt + 16)
    ws = torch.empty(n_h + n_table + segs * c.row_blocks * splits * bt, dtype=torch.float32,
                     device=x.device)
    h = ws[:n_h].view(splits, segs * bt, n_rows)
    table, scratch = ws[n_h:n_h + n_table].view(torch.int32), ws[n_h + n_table:].view(torch.int32)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # (tf32 unused in 16 bits)
    # Triton's CPU interpreter (tests) multiplies bfloat16 tiles wrongly: there, the tiles go
    # to float32 first, which a GPU's 16-bit tl.dot matches (exact products, float32 sums).
    interpreted = x.device.type != "cuda"
    _shrink_kernel[(segs, c.row_blocks, splits)](
        x, a, h, table, scratch, token_slots, n_tokens, a.shape[0], in_features, n_rows,
        c.k_per_split, x.stride(0), a.stride(0), a.stride(1), h.stride(0), h.stride(1),
        token_slots.stride(0),
        N_BINS=c.n_bins, BLOCK_T=bt, BLOCK_R=c.block_r, BLOCK_K=BLOCK_K,
        SCAN_CHUNK=c.scan_chunk, PRECISION=precision, INTERPRETED=interpreted)
    _expand_kernel[(segs, c.groups)](
        h, b, y, table, out, rank, *starts, h.stride(0), h.stride(1), b.stride(0),
        b.stride(1), y.stride(0), splits, c.blocks_per_program, N_SUB=n_sub, BLOCK_T=bt,
        BLOCK_N=c.block_n, R_PAD=c.r_pad, SUB_PAD=c.sub_pad,
        UNROLL=min(4, triton.next_power_of_2(splits)), PRECISION=precision,
        INTERPRETED=interpreted,
        num_warps=c.expand_warps)

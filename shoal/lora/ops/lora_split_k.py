"""The split-K path of the Triton LoRA op (lora_triton.py): one token per program, the
shrink's input features split over programs, for decode steps of few tokens.

- shrink: float32 partials h[split, t, rows] = A[s][rows, K-share] x[t][K-share], one program
  per token x block of rank rows x share of the input features. The split count comes from
  the shapes: a step of one token spreads its adapter's A over ~PROGRAM_TARGET programs of
  one or two K blocks each (a single load round trip: at T = 1 the kernel is latency-bound,
  and more programs put more of A's bytes in flight at once); longer steps take at least
  k_blocks / MAX_ITERS splits. The K loop is software-pipelined (tl.range num_stages).
- expand: y[t, o] += sum_r h[t, sub(o)*R + r] B[s][o, r], one program per token x block of
  output rows. It loads all the partials of a sub-projection as one [splits, R] tile and
  sums them in a fixed order (a tree over the splits: deterministic, no atomics), so their
  count costs one load round trip rather than one per split; h is rounded to x's dtype, the
  delta added in float32 and rounded once into y. A block of rows crossing a
  sub-projection boundary (q|k|v, gate|up) handles each sub-projection it touches, reading
  only its R columns of h.

Every program re-reads its adapter's A (or B) rows, from L2 for every token after the first:
this path's traffic grows with the token count, which the segmented path (lora_segmented.py)
avoids by reading them once per block of tokens of one adapter. Tiles are kept to 16
elements a thread (8 warps for 4096-element A tiles): no register spills."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.attention.ops.interpreted_half import to_dtype

PROGRAM_TARGET = 128  # shrink programs to aim for: about one per multiprocessor of an H100
MAX_SPLIT = 64  # partials each expand program sums
MAX_ITERS = 4  # K blocks a shrink program loops over, at most (where MAX_SPLIT allows)
TILE = 4096  # elements of an A tile of the shrink: 16 a thread with 8 warps (no spills)
B_TILE = 2048  # elements of a B tile of the expand
PARTIALS_TILE = 4096  # elements of the expand's [splits, R] tile of partials: caps splits


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, slots_ptr, in_features, n_rows, k_per_split,
                   stride_xt, stride_as, stride_ar, stride_hs, stride_ht, stride_slot,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Partial h[split, t, rows] over the split's k_per_split input features (float32)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t * stride_slot).to(tl.int64)
    if slot < 0:
        return
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    split = tl.program_id(2)
    a_rows = a_ptr + slot * stride_as + rows[:, None].to(tl.int64) * stride_ar
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    k_end = tl.minimum((split + 1) * k_per_split, in_features)
    for k0 in tl.range(split * k_per_split, k_end, BLOCK_K, num_stages=3):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        xk = tl.load(x_ptr + t * stride_xt + ks, mask=k_mask, other=0.0).to(tl.float32)
        ak = tl.load(a_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(ak.to(tl.float32) * xk[None, :], axis=1)
    tl.store(h_ptr + split * stride_hs + t * stride_ht + rows, acc, mask=row_mask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, slots_ptr, out_features, rank, off1, off2, off3,
                   stride_hs, stride_ht, stride_bs, stride_bo, stride_yt, stride_slot,
                   split_k, N_SUB: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr,
                   SPLIT_PAD: tl.constexpr, INTERPRETED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t * stride_slot).to(tl.int64)
    if slot < 0:
        return
    n0 = tl.program_id(1) * BLOCK_N
    rows = n0 + tl.arange(0, BLOCK_N)
    row_mask = rows < out_features
    # Each row's sub-projection; unused starts are out_features, which no row reaches.
    sub = (rows >= off1).to(tl.int32) + (rows >= off2).to(tl.int32) + (rows >= off3).to(tl.int32)
    last = tl.minimum(n0 + BLOCK_N, out_features) - 1
    sub_first = (n0 >= off1).to(tl.int32) + (n0 >= off2).to(tl.int32) + (n0 >= off3).to(tl.int32)
    sub_last = (last >= off1).to(tl.int32) + (last >= off2).to(tl.int32) \
        + (last >= off3).to(tl.int32)
    r = tl.arange(0, R_PAD)
    r_mask = r < rank
    splits = tl.arange(0, SPLIT_PAD)
    h_tile = h_ptr + t * stride_ht + splits[:, None] * stride_hs + r[None, :]
    h_mask = (splits < split_k)[:, None] & r_mask[None, :]
    b_rows = b_ptr + slot * stride_bs + rows[:, None].to(tl.int64) * stride_bo + r[None, :]
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in tl.static_range(N_SUB):
        if (sub_first <= i) & (i <= sub_last):  # the block's rows of sub-projection i
            h = tl.sum(tl.load(h_tile + i * rank, mask=h_mask, other=0.0), axis=0)
            h = to_dtype(h, y_ptr.dtype.element_ty, INTERPRETED).to(tl.float32)  # x's dtype
            mask = (row_mask & (sub == i))[:, None] & r_mask[None, :]
            bt = tl.load(b_rows, mask=mask, other=0.0)
            delta += tl.sum(bt.to(tl.float32) * h[None, :], axis=1)
    y_rows = y_ptr + t * stride_yt + rows
    y = tl.load(y_rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_rows, to_dtype(y + delta, y_ptr.dtype.element_ty, INTERPRETED), mask=row_mask)


@functools.lru_cache(maxsize=256)
def shrink_config(n_tokens: int, n_rows: int, in_features: int, max_split: int = MAX_SPLIT
                  ) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_K, splits, k_per_split) of the shrink; k_per_split a multiple of
    BLOCK_K, no split left without features, at most max_split splits."""
    block_r = min(triton.next_power_of_2(n_rows), 64)
    row_blocks = triton.cdiv(n_rows, block_r)
    want = triton.cdiv(PROGRAM_TARGET, n_tokens * row_blocks)
    block_k = min(max(triton.next_power_of_2(triton.cdiv(in_features, want)), 64),
                  max(64, TILE // block_r), triton.next_power_of_2(in_features))
    k_blocks = triton.cdiv(in_features, block_k)
    splits = min(max_split, max(want, triton.cdiv(k_blocks, MAX_ITERS)), k_blocks)
    k_per_split = triton.cdiv(k_blocks, splits) * block_k
    return block_r, block_k, triton.cdiv(in_features, k_per_split), k_per_split


def add_lora_split_k(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor,
                     starts: list[int], n_sub: int, rank: int) -> None:
    """In place, arguments checked by lora_triton.add_lora; starts: the first rows of
    sub-projections 1..3 (out where there is none)."""
    n_tokens, out = y.shape
    n_rows, in_features = n_sub * rank, x.shape[1]
    r_pad = triton.next_power_of_2(rank)
    block_r, block_k, split_k, k_per_split = shrink_config(
        n_tokens, n_rows, in_features, max(1, min(MAX_SPLIT, PARTIALS_TILE // r_pad)))
    h = torch.empty(split_k, n_tokens, n_rows, dtype=torch.float32, device=x.device)
    _shrink_kernel[(n_tokens, triton.cdiv(n_rows, block_r), split_k)](
        x, a, h, token_slots, in_features, n_rows, k_per_split,
        x.stride(0), a.stride(0), a.stride(1), h.stride(0), h.stride(1), token_slots.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=8 if block_r * block_k >= TILE else 4)
    block_n = min(triton.next_power_of_2(out), max(16, B_TILE // r_pad))
    _expand_kernel[(n_tokens, triton.cdiv(out, block_n))](
        h, b, y, token_slots, out, rank, *starts,
        h.stride(0), h.stride(1), b.stride(0), b.stride(1), y.stride(0), token_slots.stride(0),
        split_k, N_SUB=n_sub, BLOCK_N=block_n, R_PAD=r_pad,
        SPLIT_PAD=triton.next_power_of_2(split_k), INTERPRETED=x.device.type != "cuda")

"""Triton kernels of the batched multi-adapter LoRA op (the role of punica's BGMV), for CUDA
graphs: no host sync, no shape that depends on the slots' values.

- shrink: h[t] = A[s] x[t] per token, one program per token x block of rank rows x share of
  the input features (split-K: a decode step has too few tokens to fill the GPU otherwise),
  float32 partial sums into a workspace [splits, T, n_sub*R].
- expand: y[t, o] += sum_r h[t, sub(o)*R + r] B[s, o, r], one program per token x block of
  output rows. It sums the partials of h in a fixed order (deterministic, no atomics) and
  rounds h to x's dtype, like the torch path; sub(o) comes from comparing o with the
  sub-projections' first rows, so one launch serves a fused q|k|v or gate|up projection.
  Added in float32, rounded once into y.

Tokens whose slot is -1 return at once in both kernels (their rows of h are never written
nor read). A slot >= S is not checked (that would need a sync): the caller's slot table
guarantees it. Each program re-reads its adapter's A or B rows (from L2 for the tokens after
the first); a long prefill of one adapter would be better served by a segmented (SGMV)
variant with tl.dot over blocks of tokens sorted by slot: future work."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.lora.ops.lora_torch import check_args

MAX_SUBS = 4  # the expand kernel compares a row with three sub-projection starts
SPLIT_TARGET = 256  # shrink programs to aim for: about two per multiprocessor of an H100
MAX_SPLIT = 16  # partials each expand program sums
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    for k0 in range(split * k_per_split, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        xk = tl.load(x_ptr + t * stride_xt + ks, mask=k_mask, other=0.0).to(tl.float32)
        ak = tl.load(a_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(ak.to(tl.float32) * xk[None, :], axis=1)
    tl.store(h_ptr + split * stride_hs + t * stride_ht + rows, acc, mask=row_mask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, slots_ptr, out_features, rank, off1, off2, off3,
                   stride_hs, stride_ht, stride_bs, stride_bo, stride_yt, stride_slot,
                   split_k, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t * stride_slot).to(tl.int64)
    if slot < 0:
        return
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < out_features
    # The sub-projection of each row; unused starts are out_features, which no row reaches.
    sub = (rows >= off1).to(tl.int32) + (rows >= off2).to(tl.int32) + (rows >= off3).to(tl.int32)
    r = tl.arange(0, R_PAD)
    mask = row_mask[:, None] & (r < rank)[None, :]
    h_tile = h_ptr + t * stride_ht + sub[:, None] * rank + r[None, :]
    h = tl.zeros((BLOCK_N, R_PAD), dtype=tl.float32)
    for split in range(split_k):  # a fixed order: the sum does not depend on timing
        h += tl.load(h_tile + split * stride_hs, mask=mask, other=0.0)
    h = h.to(y_ptr.dtype.element_ty).to(tl.float32)  # rounded to x's dtype, as documented
    bt = tl.load(b_ptr + slot * stride_bs + rows[:, None].to(tl.int64) * stride_bo + r[None, :],
                 mask=mask, other=0.0)
    delta = tl.sum(h * bt.to(tl.float32), axis=1)
    y_rows = y_ptr + t * stride_yt + rows
    y = tl.load(y_rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_rows, (y + delta).to(y_ptr.dtype.element_ty), mask=row_mask)


def add_lora(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor,
             sub_offsets: tuple[int, ...], rank: int) -> None:
    """In place: y[t] += the LoRA delta of token t's adapter (nothing for slot -1). Same
    arguments as lora_torch.add_lora; every tensor on one device, each contiguous along its
    last dim, x, y, a and b of one dtype among float16, bfloat16 and float32."""
    bounds = check_args(y, x, a, b, token_slots, sub_offsets, rank)
    n_sub = len(bounds)
    if n_sub > MAX_SUBS:
        raise ValueError(f"{n_sub} sub-projections: the Triton LoRA kernels take at most "
                         f"{MAX_SUBS}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}: expected one of {_DTYPES}")
    for name, t in (("x", x), ("y", y), ("a", a), ("b", b)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous along its last dim, got strides "
                             f"{t.stride()}")
    if len({t.device for t in (x, y, a, b, token_slots)}) != 1:
        raise ValueError("x, y, a, b and token_slots must be on one device")
    n_tokens, out = y.shape
    if n_tokens == 0:
        return
    n_rows = n_sub * rank
    in_features = x.shape[1]
    block_r, block_k = _shrink_blocks(n_rows, in_features)
    row_blocks = triton.cdiv(n_rows, block_r)
    split_k = _split_k(n_tokens * row_blocks, triton.cdiv(in_features, block_k))
    k_per_split = triton.cdiv(triton.cdiv(in_features, block_k), split_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)  # no split left without features
    h = torch.empty(split_k, n_tokens, n_rows, dtype=torch.float32, device=x.device)
    _shrink_kernel[(n_tokens, row_blocks, split_k)](
        x, a, h, token_slots, in_features, n_rows, k_per_split,
        x.stride(0), a.stride(0), a.stride(1), h.stride(0), h.stride(1), token_slots.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k)
    starts = [lo for lo, _ in bounds[1:]] + [out] * (MAX_SUBS - n_sub)
    r_pad = triton.next_power_of_2(rank)
    block_n = _expand_block(out, r_pad)
    _expand_kernel[(n_tokens, triton.cdiv(out, block_n))](
        h, b, y, token_slots, out, rank, *starts,
        h.stride(0), h.stride(1), b.stride(0), b.stride(1), y.stride(0), token_slots.stride(0),
        split_k, BLOCK_N=block_n, R_PAD=r_pad)


def _shrink_blocks(n_rows: int, in_features: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K): an A tile of at most 8192 elements."""
    block_r = min(triton.next_power_of_2(n_rows), 64)
    return block_r, min(triton.next_power_of_2(in_features), max(16, 8192 // block_r))


def _expand_block(out_features: int, r_pad: int) -> int:
    """BLOCK_N: a B tile of at most 4096 elements."""
    return min(triton.next_power_of_2(out_features), max(16, 4096 // r_pad))


def _split_k(n_programs: int, k_blocks: int) -> int:
    """Splits of the input features for the shrink: a decode step has too few tokens to fill
    the GPU with one program per token and block of rank rows, so each also takes a share of
    the features; the expand sums the partials."""
    return max(1, min(SPLIT_TARGET // n_programs, k_blocks, MAX_SPLIT))

"""The fused decode path of the Triton LoRA op (lora_triton.py): shrink and expand in one
launch, for steps of one to a few tokens.

At batch 1 the split-K pair (lora_split_k.py) is two latency-bound launches per adapted
projection (four projections x 32 layers: 256 launches a decode step of an 8B model), each a
few microseconds against a few hundred KB of adapter weights. Here one program per token x
block of output rows computes the whole shrink it needs, h_i = A[s][i*R:(i+1)*R] x over all
the input features, for each sub-projection i (q|k|v, gate|up) its rows touch, then its rows'
delta y[t, rows] += B[s][rows] h_sub(row). Every program of a token re-reads A's R x K slice
(at rank 16 and K = 4096, 128 KB) from L2: cheap beside a launch at a few tokens, and the
reason this path stops there (lora_triton.FUSED_MAX_TOKENS). The programs of a token are kept
to about PROGRAM_TARGET (each takes several blocks of rows where the output is wide) so that
the L2 traffic of these re-reads stays a few MB.

Rounding is the split-K path's: h summed in float32 and rounded to x's dtype, the delta
summed in float32, added to y in float32 and rounded once. Only the order of the float32
sums differs (one running sum a thread over K, then a tree, where split-K sums shares of K
and then its partials), so the two agree bit for bit where those sums do, and within one
rounding of h otherwise.

Tiles are at most 16 elements a thread with 8 warps (4,096-element A and B tiles), as in
split-K: no register spills. The K loop is software-pipelined (tl.range num_stages): a
program's A slice is many tiles, and one tile in flight at a time would leave it waiting a
round trip to L2 per tile."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from shoal.attention.ops.interpreted_half import to_dtype

TILE = 4096  # elements of an A tile ([R_PAD, BLOCK_K]) and a B tile ([BLOCK_N, R_PAD])
NUM_WARPS = 8  # 256 threads: 16 elements of a 4,096-element tile each
NUM_STAGES = 4  # A tiles in flight (shared memory: 3 x 8 KB in bf16)
PROGRAM_TARGET = 64  # programs a step aims for (tokens x row programs), at least one a token
SUB_PAD = 4  # sub-projections h is kept for (lora_triton.MAX_SUBS)


@dataclass(frozen=True)
class FusedConfig:
    block_k: int  # input features of an A tile
    block_n: int  # output rows of a B tile
    chunks: int  # B tiles (blocks of block_n rows) a program loops over
    r_pad: int  # rank, padded to a power of two

    @property
    def rows_per_program(self) -> int:
        return self.block_n * self.chunks


@triton.jit
def _shrink_rows(x_row, a_rows, r_mask, in_features, BLOCK_K: tl.constexpr,
                 R_PAD: tl.constexpr, NUM_STAGES: tl.constexpr):
    """sum_k A[rows, k] x[k] over all the input features, in float32: a [R_PAD, BLOCK_K]
    running sum (one a thread and element), reduced once at the end."""
    acc = tl.zeros((R_PAD, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, in_features, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < in_features
        xk = tl.load(x_row + ks, mask=k_mask, other=0.0).to(tl.float32)
        ak = tl.load(a_rows + ks[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += ak.to(tl.float32) * xk[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _sub_of(rows, off1, off2, off3):
    """Each row's sub-projection; unused starts are out_features, which no row reaches."""
    return (rows >= off1).to(tl.int32) + (rows >= off2).to(tl.int32) \
        + (rows >= off3).to(tl.int32)


@triton.jit
def _fused_kernel(x_ptr, a_ptr, b_ptr, y_ptr, slots_ptr, in_features, out_features, rank,
                  off1, off2, off3, chunks, stride_xt, stride_as, stride_ar, stride_bs,
                  stride_bo, stride_yt, stride_slot, N_SUB: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr,
                  SUB_PAD: tl.constexpr, NUM_STAGES: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t * stride_slot).to(tl.int64)
    if slot < 0:
        return
    p0 = tl.program_id(1) * chunks * BLOCK_N
    p_end = tl.minimum(p0 + chunks * BLOCK_N, out_features)
    sub_first = _sub_of(p0, off1, off2, off3)
    sub_last = _sub_of(p_end - 1, off1, off2, off3)
    r = tl.arange(0, R_PAD)
    r_mask = r < rank
    x_row = x_ptr + t * stride_xt
    a_slot = a_ptr + slot * stride_as
    # h of the sub-projections this program's rows touch, row i of hs; x's dtype, widened
    subs = tl.arange(0, SUB_PAD)
    hs = tl.zeros((SUB_PAD, R_PAD), dtype=tl.float32)
    for i in tl.static_range(N_SUB):
        if (sub_first <= i) & (i <= sub_last):
            a_rows = a_slot + (i * rank + r)[:, None].to(tl.int64) * stride_ar
            h = _shrink_rows(x_row, a_rows, r_mask, in_features, BLOCK_K, R_PAD, NUM_STAGES)
            h = to_dtype(h, y_ptr.dtype.element_ty, INTERPRETED).to(tl.float32)
            hs = tl.where((subs == i)[:, None], h[None, :], hs)
    b_slot = b_ptr + slot * stride_bs
    for c in range(0, chunks):
        rows = p0 + c * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < p_end
        sub = _sub_of(rows, off1, off2, off3)
        h_rows = tl.zeros((BLOCK_N, R_PAD), dtype=tl.float32)  # each row's h
        for i in tl.static_range(N_SUB):
            h = tl.sum(tl.where((subs == i)[:, None], hs, 0.0), axis=0)
            h_rows = tl.where((sub == i)[:, None], h[None, :], h_rows)
        bt = tl.load(b_slot + rows[:, None].to(tl.int64) * stride_bo + r[None, :],
                     mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        delta = tl.sum(bt.to(tl.float32) * h_rows, axis=1)
        y_rows = y_ptr + t * stride_yt + rows
        y = tl.load(y_rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(y_rows, to_dtype(y + delta, y_ptr.dtype.element_ty, INTERPRETED),
                 mask=row_mask)


@functools.lru_cache(maxsize=256)
def fused_config(n_tokens: int, out_features: int, in_features: int, rank: int) -> FusedConfig:
    """Tiles of TILE elements; a token's row programs kept to about PROGRAM_TARGET / tokens
    (each re-reads A's slice: the fewer, the less L2 traffic, down to one B tile a program)."""
    r_pad = triton.next_power_of_2(rank)
    block_k = max(16, min(TILE // r_pad, triton.next_power_of_2(in_features)))
    block_n = max(16, min(TILE // r_pad, triton.next_power_of_2(out_features)))
    row_blocks = triton.cdiv(out_features, block_n)
    chunks = triton.cdiv(row_blocks, max(1, PROGRAM_TARGET // n_tokens))
    return FusedConfig(block_k, block_n, chunks, r_pad)


def add_lora_fused_decode(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor,
                          starts: list[int], n_sub: int, rank: int) -> None:
    """In place, arguments checked by lora_triton.add_lora (as add_lora_split_k's); starts:
    the first rows of sub-projections 1..3 (out where there is none)."""
    n_tokens, out = y.shape
    if n_sub > SUB_PAD:
        raise ValueError(f"n_sub {n_sub}: the fused LoRA kernel takes at most {SUB_PAD}")
    cfg = fused_config(n_tokens, out, x.shape[1], rank)
    _fused_kernel[(n_tokens, triton.cdiv(out, cfg.rows_per_program))](
        x, a, b, y, token_slots, x.shape[1], out, rank, *starts, cfg.chunks,
        x.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0),
        token_slots.stride(0), N_SUB=n_sub, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n,
        R_PAD=cfg.r_pad, SUB_PAD=SUB_PAD, NUM_STAGES=NUM_STAGES,
        INTERPRETED=x.device.type != "cuda", num_warps=NUM_WARPS)

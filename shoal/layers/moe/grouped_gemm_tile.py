"""The parts every grouped expert GEMM kernel shares (bf16, FP8, INT4, MXFP4): which block of
(token, slot) pairs and which N tile a program computes, and the tile's epilogue (per-expert
bias, routing weight, store). Only the K loop, which reads each weight format, differs.

A program's tile: block pid // cdiv(N, BLOCK_N) of the expert-grouped pairs (align.py: all
BLOCK_M rows of one expert, padding rows hold num_pairs, unused tail blocks expert -1) and
N tile pid % cdiv(N, BLOCK_N). Kernels exit at once on expert < 0, before reading the block's
pairs, so a captured graph's worst-case grid costs little."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_expert(pid, n_out, block_expert_ptr, BLOCK_N: tl.constexpr):
    """(block index, N tile index, expert of the block: -1 for an unused block)."""
    num_n = tl.cdiv(n_out, BLOCK_N)
    pid_m = pid // num_n
    return pid_m, pid % num_n, tl.load(block_expert_ptr + pid_m)


@triton.jit
def tile_pairs(pid_m, pid_n, sorted_ids_ptr, num_pairs, a_row_div, n_out,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(pairs, valid, rows, offs_n, n_mask): the block's pair ids, which are real (padding
    rows hold num_pairs), the input row of each (pair // a_row_div, int64), and the tile's
    output columns with their bound mask."""
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pairs, valid, rows, offs_n, offs_n < n_out


@triton.jit
def store_tile(acc, c_ptr, stride_cm, pairs, valid, offs_n, n_mask, expert, bias_ptr,
               stride_bias, weights_ptr, HAS_BIAS: tl.constexpr, MUL_WEIGHTS: tl.constexpr):
    """c[pair, n] = (acc (+ bias[expert, n])) (* weights[pair]) for the tile's real pairs;
    the bias is added before the routing weight (gpt-oss)."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_bias + offs_n, mask=n_mask,
                       other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    if MUL_WEIGHTS:
        routing = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
        acc = acc * routing.to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])

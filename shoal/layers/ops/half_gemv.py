"""y = x W^T (+ b) for a few decode rows with a dense bf16/fp16 weight W [N, K] (nn.Linear's
layout), on CUDA cores: a batch-1 decode step is a weight read, and cuBLAS reaches 0.63 of
the read's time at GPT-OSS's narrow attention shapes (hidden 2880) plus a split-K reduce
launch. Each program streams a strip of BLOCK_N weight rows over its share of K with 16-byte
loads (8 halves), multiplies them with all M <= MAX_ROWS activation rows and accumulates in
float32; the output is in x's dtype.

The tile is laid out so that Triton gives the weight load, the activation load and their
product one layout: a step is [VECS, BLOCK_M, BLOCK_N, 8] with each thread holding one
16-byte vector of every strip row (and the matching 8 inputs of every activation row), the
32 lanes and the warps side by side along K (BLOCK_K = 8 x 32 x warps). Rows then share
their activations in registers and no layout conversion (a trip through shared memory and a
barrier) sits in the loop. K's vector axis comes first because Triton 3.6's coalescing
orders the axes after the contiguous one by index, so lanes and warps go to axis 0 first,
and K's is the one axis as long in the weight tile as in the activation tile (the rows of
the one are [1] in the other). The 8 products of a vector are summed inside the thread every step; the sum across
lanes and warps is made once, at the end.

The main loop's loads have no per-element masks: rows past N and M re-read the last row
(their sums are never stored), a K range's last partial step runs once, masked, after the
loop, and prefetch's load past the last whole step is off by one uniform predicate.

split > 1 (for N too narrow to give every multiprocessor several programs): K is cut into
`split` ranges, each program writes float32 partials [split, M, N], and a second small
kernel adds them in split order, adds the bias and rounds (no atomics: the same inputs give
the same bits, in a CUDA graph or not). Unsplit, the bias is added in the GEMV itself."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal import pdl

MAX_ROWS = 8  # activation rows one program holds
VEC = 8  # halves a 16-byte load reads
HALF_DTYPES = (torch.bfloat16, torch.float16)
SUM_BLOCK = 512  # outputs a program of the split-summing kernel writes


@dataclass(frozen=True)
class HalfGemvTile:
    """One launch shape: BLOCK_N weight rows a program, BLOCK_K = block_k inputs a step (a
    multiple of VEC; on a GPU 256 x num_warps, see the module docstring), K cut into `split`
    ranges (1: no partials, one launch)."""
    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    prefetch: bool = False  # the next step's weight loads issued before this step's math

    @property
    def name(self) -> str:
        return (f"half gemv n{self.block_n} k{self.block_k} split{self.split} "
                f"w{self.num_warps}" + (" prefetch" if self.prefetch else ""))


@triton.jit
def _half_gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, K_SPLIT,
                      stride_xm, stride_wn, stride_os, stride_om,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, VEC: tl.constexpr, PREFETCH: tl.constexpr,
                      PDL: tl.constexpr = False):
    VECS: tl.constexpr = BLOCK_K // VEC
    pdl.launch_next(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.arange(0, BLOCK_M)
    # rows past the ends re-read the last row: no load in the loop needs a row mask
    safe_n = tl.minimum(rows_n, N - 1).to(tl.int64)
    safe_m = tl.minimum(rows_m, M - 1).to(tl.int64)
    # a step is [VECS, BLOCK_M, BLOCK_N, VEC]: K's vectors first (see the module docstring)
    offs_k = tl.arange(0, VECS)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [VECS, VEC]
    w_step = w_ptr + safe_n[None, None, :, None] * stride_wn + offs_k[:, None, None, :]
    x_step = x_ptr + safe_m[None, :, None, None] * stride_xm + offs_k[:, None, None, :]
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    k_full = k_start + (k_end - k_start) // BLOCK_K * BLOCK_K
    acc = tl.zeros([VECS, BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PREFETCH:  # the next step's weights load while this step's are multiplied
        # (a whole step or none: the masks are uniform across a vector and a thread)
        step_k = offs_k[:, None, None, :]
        w_next = tl.load(w_step + k_start, mask=k_start + step_k < k_full, other=0.0)
        pdl.wait_previous(PDL)  # (weights are no step's output: their first read goes early)
        for k0 in range(k_start, k_full, BLOCK_K):
            w = w_next.to(tl.float32)
            w_next = tl.load(w_step + (k0 + BLOCK_K), mask=k0 + BLOCK_K + step_k < k_full,
                             other=0.0)
            x = tl.load(x_step + k0).to(tl.float32)
            acc += tl.sum(w * x, axis=3)
    else:
        pdl.wait_previous(PDL)
        for k0 in range(k_start, k_full, BLOCK_K):
            w = tl.load(w_step + k0).to(tl.float32)  # [VECS, 1, BLOCK_N, VEC]
            x = tl.load(x_step + k0).to(tl.float32)  # [VECS, BLOCK_M, 1, VEC]
            acc += tl.sum(w * x, axis=3)  # (the VEC axis is within a thread: no shuffles)
    if k_full < k_end:  # the range's last, partial step
        k_ok = (k_full + offs_k < k_end)[:, None, None, :]
        w = tl.load(w_step + k_full, mask=k_ok, other=0.0).to(tl.float32)
        x = tl.load(x_step + k_full, mask=k_ok, other=0.0).to(tl.float32)
        acc += tl.sum(w * x, axis=3)
    y = tl.sum(acc, axis=0)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + safe_n).to(tl.float32)[None, :]
    out = (out_ptr + pid_k.to(tl.int64) * stride_os + rows_m.to(tl.int64)[:, None] * stride_om
           + rows_n[None, :])
    tl.store(out, y.to(out_ptr.dtype.element_ty),
             mask=(rows_m < M)[:, None] & (rows_n < N)[None, :])


@triton.jit
def sum_splits_kernel(part_ptr, b_ptr, out_ptr, M, N, SPLIT, stride_om,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, n] = sum over s in order of part[s, m, n] (+ b[n]), rounded once."""
    pdl.grid_dependency(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs = pid_n * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + (s * M + pid_m).to(tl.int64) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + offs,
             acc.to(out_ptr.dtype.element_ty), mask=ok)


def k_per_split(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(inputs each split covers: whole steps; splits left with inputs)."""
    span = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    return span, triton.cdiv(k, span)


def half_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              tile: HalfGemvTile) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS; rows may be strided, inputs contiguous), weight [N, K]
    and bias [N] or None, all of one half dtype -> [M, N] in that dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"half_gemv: x has {m} rows; it takes 1..{MAX_ROWS}")
    if x.dtype not in HALF_DTYPES or weight.dtype != x.dtype or (
            bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"half_gemv: x {x.dtype}, weight {weight.dtype}, bias "
                         f"{None if bias is None else bias.dtype}: one of {HALF_DTYPES} for all")
    if weight.dim() != 2 or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"half_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} need "
                         "the same K and contiguous rows")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"half_gemv: bias {tuple(bias.shape)} must be [{n}], contiguous")
    if tile.block_k % VEC or tile.split < 1:
        raise ValueError(f"half_gemv: block_k {tile.block_k} must be a multiple of {VEC} and "
                         f"split {tile.split} >= 1")
    span, split = k_per_split(k, tile.block_k, tile.split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = triton.next_power_of_2(m)
    launch = dict(BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, VEC=VEC,
                  PREFETCH=tile.prefetch, num_warps=tile.num_warps,
                  num_stages=1,  # (Triton pipelines no load of a loop without tl.dot)
                  **pdl.kwargs(x.device))
    grid = (triton.cdiv(n, tile.block_n), split)
    if split == 1:
        _half_gemv_kernel[grid](x, weight, bias if bias is not None else x, out, m, n, k, span,
                                x.stride(0), weight.stride(0), 0, n,
                                HAS_BIAS=bias is not None, **launch)
        return out
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _half_gemv_kernel[grid](x, weight, x, part, m, n, k, span, x.stride(0), weight.stride(0),
                            m * n, n, HAS_BIAS=False, **launch)
    sum_splits_kernel[(m, triton.cdiv(n, SUM_BLOCK))](
        part, bias if bias is not None else x, out, m, n, split, n, HAS_BIAS=bias is not None,
        BLOCK=SUM_BLOCK, num_warps=4, **pdl.kwargs(x.device))
    return out


# GPU tiles per row bucket: (block_n, warps, prefetch), block_k = 256 x warps. Each thread
# loads block_n 16-byte weight vectors a step (twice that in flight with prefetch) and holds
# rows x 8 activations and rows x block_n float32 sums: one row affords wide strips, eight
# narrow ones. Registers from Triton 3.6's sm_90 compiler (no spills; bench-work/helpers/
# compile_sm90_half_gemv.py), 4 warps: 1 row n4 40, n4 prefetch 59, n8 80, n16 (2 warps)
# 127; 8 rows n2 prefetch 106, n4 139, n4 prefetch 150, n8 201.
_GPU_TILES = {1: ((4, 4, False), (4, 4, True), (8, 4, False), (16, 2, False)),
              2: ((4, 4, False), (4, 4, True), (8, 4, False), (8, 4, True)),
              4: ((4, 4, False), (4, 4, True), (8, 4, False), (2, 4, True)),
              8: ((4, 4, False), (4, 4, True), (2, 4, True), (8, 4, False))}
PROGRAMS_PER_SM = 4  # below this many programs a multiprocessor, K is split
MIN_STEPS = 2  # whole steps a split keeps at least


def split_for(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """Powers of two while the strips are too few for PROGRAMS_PER_SM programs on each of
    `sms` multiprocessors and each split keeps MIN_STEPS steps."""
    strips, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split = 1
    while strips * split < PROGRAMS_PER_SM * sms and steps >= 2 * split * MIN_STEPS:
        split *= 2
    return split


@functools.cache
def candidates(n: int, k: int, rows: int, device: torch.device) -> tuple[HalfGemvTile, ...]:
    """The launch shapes worth timing for a weight [N, K] at `rows` activation rows (1 to
    MAX_ROWS) on `device`: gpu_tiles for its multiprocessors. The interpreter (a CPU
    device) gets three small tiles: split or not, prefetch."""
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"half_gemv candidates: rows {rows} must be in 1..{MAX_ROWS}")
    if device.type != "cuda":
        return (HalfGemvTile(4, 64, 1), HalfGemvTile(8, 32, 2),
                HalfGemvTile(4, 16, 1, prefetch=True))
    return gpu_tiles(n, k, rows, torch.cuda.get_device_properties(device).multi_processor_count)


def gpu_tiles(n: int, k: int, rows: int, sms: int) -> tuple[HalfGemvTile, ...]:
    """Each tile of _GPU_TILES for the rows' power-of-two bucket, at its split for a GPU of
    `sms` multiprocessors."""
    out = []
    for block_n, warps, prefetch in _GPU_TILES[triton.next_power_of_2(rows)]:
        block_k = 32 * VEC * warps
        out.append(HalfGemvTile(block_n, block_k, split_for(n, k, block_n, block_k, sms),
                                num_warps=warps, prefetch=prefetch))
    return tuple(out)

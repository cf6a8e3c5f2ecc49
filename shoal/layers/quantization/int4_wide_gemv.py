"""INT4 weight-only GEMV for 1..8 rows, written for the rate a Hopper SM must retire 4-bit
codes at to keep up with its share of 3 TB/s (about 26 a clock): the "wide" launch
candidates of decode_gemv.int4_gemv.

The strip kernel of decode_gemv.py costs about 8 instructions a code at one row on sm_90
(an integer shift, mask and convert per code, and with 4 words a thread per K step its loop
overhead: addresses, masks, a division for the group, a layout change of the scales), and
with several rows it reduces across threads for every nibble. Here (Triton's sm_90 output:
3.7 a code at one row, 5.4 at two, 8.6 at four, 14 at eight):

- two instructions make the float, no conversion: the nibble is masked where it lies (bit
  s of the word) and or-ed with the exponent of 2^(23 - s), so the bits read as
  2^(23 - s) + code; one subtraction of 2^(23 - s) + zero leaves code - zero exactly.
  Nibbles 0..4 lie at bits 0..19 of the word, 5..7 at bits 4..15 of the word shifted by
  16 (one shift a word). The exponents derive from MAGIC, a kernel argument: ptxas keeps
  the five in registers and takes each mask as the immediate of one LOP3 (with constant
  exponents it re-creates a register constant before every LOP3);
- one multiply-add a row: STEP_W words of each of a thread's columns (one scale group)
  add up elementwise in registers, summed over the words and multiplied by the scale once
  per step; the rows share every dequantized code, and each activation load serves all of
  a thread's columns.

Layout (what the candidates keep): BLOCK_N = 128 * num_warps * R columns, so Triton gives
each thread 4R columns (vector loads of 4 words) across all 32 lanes and warps, and the
STEP_W words of a step stay inside the thread: no reduction crosses threads inside the loop.
PREFETCH loads the next step's words before the current step's arithmetic (two steps of
loads in flight a thread, at twice the word registers).

A K split over programs (SPLIT > 1) writes float32 partials [SPLIT, M, N]; the program that
finishes a strip last (a per-strip counter, reset by that program) adds them in split order
and writes the output: deterministic, and no second kernel (the strip path's `sum` and
cast cost two more launches, microseconds against a 3 us o_proj)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.layers.quantization.k_split import k_split

EXP_2_23 = 0x4B000000  # float32 bits of 2^23 (MAGIC)


@triton.jit
def _nibbles(words, high, magic, zero, J: tl.constexpr, SH: tl.constexpr):
    """code J - zero as float32 for each word: the bits of nibble J (at bit SH of the word
    or of `high`) with the exponent of 2^(23 - SH) read as 2^(23 - SH) + code."""
    if J < 5:
        bits = (words & (0xF << SH)) | (magic - (SH << 23))
    else:
        bits = (high & (0xF << SH)) | (magic - (SH << 23))
    return bits.to(tl.float32, bitcast=True) - (zero + (1 << (23 - SH)))


@triton.jit
def _row_fma(s, code, x_ptrs, row_off, ks, k_end, J: tl.constexpr, EVEN_K: tl.constexpr):
    """s + code * x, x: input J of each word of the row at x_ptrs + row_off."""
    if EVEN_K:
        x = tl.load(x_ptrs + row_off + J)
    else:
        x = tl.load(x_ptrs + row_off + J, mask=ks + J < k_end, other=0.0)
    return s + code * x.to(tl.float32)[:, None]


@triton.jit
def _fma_rows(s0, s1, s2, s3, s4, s5, s6, s7, code, x_ptrs, stride_xm, M, ks, k_end,
              J: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """Every row's s += code * x: the rows share the dequantized code. Rows past M (in a
    block of a power of two) read row M - 1 instead of masking each load; their sums are
    never stored."""
    last = M - 1
    s0 = _row_fma(s0, code, x_ptrs, 0, ks, k_end, J, EVEN_K)
    if BLOCK_M > 1:
        s1 = _row_fma(s1, code, x_ptrs, tl.minimum(last, 1) * stride_xm, ks, k_end, J, EVEN_K)
    if BLOCK_M > 2:
        s2 = _row_fma(s2, code, x_ptrs, tl.minimum(last, 2) * stride_xm, ks, k_end, J, EVEN_K)
        s3 = _row_fma(s3, code, x_ptrs, tl.minimum(last, 3) * stride_xm, ks, k_end, J, EVEN_K)
    if BLOCK_M > 4:
        s4 = _row_fma(s4, code, x_ptrs, tl.minimum(last, 4) * stride_xm, ks, k_end, J, EVEN_K)
        s5 = _row_fma(s5, code, x_ptrs, tl.minimum(last, 5) * stride_xm, ks, k_end, J, EVEN_K)
        s6 = _row_fma(s6, code, x_ptrs, tl.minimum(last, 6) * stride_xm, ks, k_end, J, EVEN_K)
        s7 = _row_fma(s7, code, x_ptrs, tl.minimum(last, 7) * stride_xm, ks, k_end, J, EVEN_K)
    return s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _store_row(total, out_ptr, ROW: tl.constexpr, M, N, offs_n, n_ok):
    ok = n_ok & (offs_n * 0 + ROW < M)  # (a tensor: the interpreter takes no bool masks)
    tl.store(out_ptr + ROW * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_rows(a0, a1, a2, a3, a4, a5, a6, a7, out_ptr, M, N, offs_n, n_ok,
                BLOCK_M: tl.constexpr):
    _store_row(a0, out_ptr, 0, M, N, offs_n, n_ok)
    if BLOCK_M > 1:
        _store_row(a1, out_ptr, 1, M, N, offs_n, n_ok)
    if BLOCK_M > 2:
        _store_row(a2, out_ptr, 2, M, N, offs_n, n_ok)
        _store_row(a3, out_ptr, 3, M, N, offs_n, n_ok)
    if BLOCK_M > 4:
        _store_row(a4, out_ptr, 4, M, N, offs_n, n_ok)
        _store_row(a5, out_ptr, 5, M, N, offs_n, n_ok)
        _store_row(a6, out_ptr, 6, M, N, offs_n, n_ok)
        _store_row(a7, out_ptr, 7, M, N, offs_n, n_ok)


@triton.jit
def _split_part(part_ptr, s0, ROW: tl.constexpr, M, N, offs_n, n_ok, SPLIT,
                CHUNK: tl.constexpr):
    """The sum of partials s0 .. s0 + CHUNK - 1 of row ROW: one load of a [CHUNK, BLOCK_N]
    tile (a round trip to L2 per CHUNK programs, not per program), summed in a fixed order
    inside each thread. .cg: read at L2, where the other programs wrote them."""
    ss = s0 + tl.arange(0, CHUNK)
    ok = (ss < SPLIT)[:, None] & (n_ok & (offs_n * 0 + ROW < M))[None, :]
    tile = tl.load(part_ptr + (ss[:, None] * M + ROW) * N + offs_n[None, :], mask=ok,
                   other=0.0, cache_modifier=".cg")
    return tl.sum(tile, axis=0)


@triton.jit
def _split_sums(part_ptr, M, N, offs_n, n_ok, SPLIT, CHUNK: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Every row's partials of the strip's SPLIT programs, added in split order by chunks."""
    t0 = tl.zeros([offs_n.shape[0]], dtype=tl.float32)
    t1, t2, t3, t4, t5, t6, t7 = t0, t0, t0, t0, t0, t0, t0
    for s0 in range(0, SPLIT, CHUNK):
        t0 += _split_part(part_ptr, s0, 0, M, N, offs_n, n_ok, SPLIT, CHUNK)
        if BLOCK_M > 1:
            t1 += _split_part(part_ptr, s0, 1, M, N, offs_n, n_ok, SPLIT, CHUNK)
        if BLOCK_M > 2:
            t2 += _split_part(part_ptr, s0, 2, M, N, offs_n, n_ok, SPLIT, CHUNK)
            t3 += _split_part(part_ptr, s0, 3, M, N, offs_n, n_ok, SPLIT, CHUNK)
        if BLOCK_M > 4:
            t4 += _split_part(part_ptr, s0, 4, M, N, offs_n, n_ok, SPLIT, CHUNK)
            t5 += _split_part(part_ptr, s0, 5, M, N, offs_n, n_ok, SPLIT, CHUNK)
            t6 += _split_part(part_ptr, s0, 6, M, N, offs_n, n_ok, SPLIT, CHUNK)
            t7 += _split_part(part_ptr, s0, 7, M, N, offs_n, n_ok, SPLIT, CHUNK)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _int4_wide_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                      K_SPLIT, SPLIT, stride_xm, stride_wk, stride_sg, MAGIC,
                      GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP_W: tl.constexpr,
                      SPLIT_K: tl.constexpr, CHUNK: tl.constexpr, PREFETCH: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, STEP_W)
    n_ok = offs_n < N
    # scales and zeros in 4-column vectors: the words' layout, so that the sums over a
    # step's words meet them (and the accumulators) without a layout change
    offs_s = tl.max_contiguous(offs_n, 4)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    w_ptrs = w_ptr + (k_start // 8 + offs_w).to(tl.int64)[:, None] * stride_wk + offs_n[None, :]
    x_ptrs = x_ptr + k_start + offs_w * 8  # row 0; row m at + m * stride_xm
    ks = k_start + offs_w * 8  # first input of each word
    step_rows = STEP_W * stride_wk
    a0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    if PREFETCH:
        nxt = tl.load(w_ptrs, mask=(ks < k_end)[:, None] & n_ok[None, :], other=0)
    for k0 in range(k_start, k_end, STEP_W * 8):
        if PREFETCH:  # this step's words came with the last step; ask for the next ones
            words = nxt
            nxt = tl.load(w_ptrs + step_rows,
                          mask=(ks + STEP_W * 8 < k_end)[:, None] & n_ok[None, :], other=0)
        elif EVEN_K:
            words = tl.load(w_ptrs, mask=n_ok[None, :], other=0)
        else:
            words = tl.load(w_ptrs, mask=(ks < k_end)[:, None] & n_ok[None, :], other=0)
        g = (k0 // GROUP) * stride_sg  # one group a step (STEP_W * 8 divides it)
        scale = tl.load(s_ptr + g + offs_s, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + g + offs_s, mask=n_ok, other=0).to(tl.float32)[None, :]
        else:
            zero = 8.0
        high = words >> 16  # nibbles 5..7 at bits 4..15 (sign bits above are masked off)
        s0 = tl.zeros([STEP_W, BLOCK_N], dtype=tl.float32)
        s1, s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0, s0
        for j in tl.static_range(8):
            code = _nibbles(words, high, MAGIC, zero, j, 4 * j if j < 5 else 4 * j - 16)
            s0, s1, s2, s3, s4, s5, s6, s7 = _fma_rows(
                s0, s1, s2, s3, s4, s5, s6, s7, code, x_ptrs, stride_xm, M, ks, k_end, j,
                EVEN_K, BLOCK_M)
        a0 += tl.sum(s0, axis=0) * scale
        if BLOCK_M > 1:
            a1 += tl.sum(s1, axis=0) * scale
        if BLOCK_M > 2:
            a2 += tl.sum(s2, axis=0) * scale
            a3 += tl.sum(s3, axis=0) * scale
        if BLOCK_M > 4:
            a4 += tl.sum(s4, axis=0) * scale
            a5 += tl.sum(s5, axis=0) * scale
            a6 += tl.sum(s6, axis=0) * scale
            a7 += tl.sum(s7, axis=0) * scale
        w_ptrs += step_rows
        x_ptrs += STEP_W * 8
        ks += STEP_W * 8
    if SPLIT_K:  # partials first; the count tells the strip's last program they are written
        _store_rows(a0, a1, a2, a3, a4, a5, a6, a7, part_ptr + pid_k.to(tl.int64) * M * N, M,
                    N, offs_n, n_ok, BLOCK_M)
        tl.debug_barrier()  # every thread's partial is written before the count goes up
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == SPLIT - 1:
            a0, a1, a2, a3, a4, a5, a6, a7 = _split_sums(part_ptr, M, N, offs_n, n_ok, SPLIT,
                                                         CHUNK, BLOCK_M)
            _store_rows(a0, a1, a2, a3, a4, a5, a6, a7, out_ptr, M, N, offs_n, n_ok, BLOCK_M)
            tl.store(count_ptr + pid_n, 0)  # ready for the next launch
    else:
        _store_rows(a0, a1, a2, a3, a4, a5, a6, a7, out_ptr, M, N, offs_n, n_ok, BLOCK_M)


def partial_chunk(rows: int, columns: int) -> int:
    """Partials the last program reads in one round trip: about 128 values a thread (not
    tied to the split, so that the splits of a tile share one compiled kernel)."""
    return max(1, 128 // (rows * max(columns, 1)))


def int4_wide_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor | None, group: int, *, block_n: int, step_w: int,
                   split: int, prefetch: bool, num_warps: int, num_stages: int
                   ) -> torch.Tensor:
    """x [M, K] (M <= 8), codes int32 [ceil(K / 8), N], scales [G, N], zeros uint8 [G, N]
    or None (8) -> [M, N] in x's dtype. step_w * 8 divides the group unless one group spans
    K; split: programs per strip along K. The kernel holds M rounded up to a power of two."""
    m, k = x.shape
    n = codes.shape[1]
    if codes.shape[0] != triton.cdiv(k, 8) or scales.shape[1] != n or x.stride(1) != 1 \
            or codes.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError(f"int4 wide GEMV: x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
                         f"scales {tuple(scales.shape)} do not fit (rows contiguous)")
    if not 0 < m <= 8:
        raise ValueError(f"int4 wide GEMV takes 1..8 rows, got {m}")
    rows = 1 << (m - 1).bit_length()
    for name, v in (("block_n", block_n), ("step_w", step_w)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"int4 wide GEMV: {name} {v} must be a power of two")
    if split < 1:
        raise ValueError(f"int4 wide GEMV: split {split} must be at least 1")
    if group < k and group % (step_w * 8):
        raise ValueError(f"int4 wide GEMV: step_w {step_w} x 8 must divide the group {group}")
    if zeros is not None and (zeros.shape != scales.shape or zeros.stride() != scales.stride()):
        raise ValueError("int4 wide GEMV: zeros must match scales in shape and strides")
    step = step_w * 8
    ks = k_split(x, n, k, step, split, block_n, "int4 wide GEMV")
    _int4_wide_kernel[(ks.strips, ks.split)](
        x, codes, scales, zeros if zeros is not None else scales, ks.out, ks.part, ks.count,
        m, n, k, ks.span, ks.split, x.stride(0), codes.stride(0), scales.stride(0), EXP_2_23,
        GROUP=group if group < k else 1 << 30, HAS_ZERO=zeros is not None,
        EVEN_K=k % step == 0, BLOCK_M=rows, BLOCK_N=block_n, STEP_W=step_w,
        SPLIT_K=ks.split > 1, CHUNK=partial_chunk(rows, block_n // (32 * num_warps)),
        PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages)
    return ks.out

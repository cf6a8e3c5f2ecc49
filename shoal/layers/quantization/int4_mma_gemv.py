"""INT4 weight-only GEMV for 1..8 rows on tensor cores: the "mma" launch candidates of
decode_gemv.int4_gemv, beside the wide kernel's CUDA-core FMAs (int4_wide_gemv.py).

The wide kernel spends about 3.7 instructions a 4-bit code at one row (Triton's sm_90 output),
and on the H200 its GEMVs ran at ~2 TB/s of 4.8 (2026-12-06: Llama-3.1-8B's gate_up 30.6 us
for 60 MB). Here the products go to the tensor cores and a code costs about two instructions
(Triton 3.9's sm_90 output for this file, 256 outputs a program over 4 warps: 1.9):

- the weight tile is the dot's A operand, out^T [N, 8] = W [N, K] . x^T [K, 8]: the outputs
  are the MMA's rows and the (padded) activation rows its 8 columns, so no tensor-core row
  is spent on padding past the 8 rows a decode step has at most;
- one LOP3 makes two bf16 (fp16) values from one 32-bit word, the nibbles at bits s and
  s + 16 or-ed into the mantissas of 128 (1024): the packed pair reads as 128 + code twice
  (`_pairs`, inline PTX; a plain Triton twin where the interpreter runs). The dot's K axis
  takes them in that order: pair set j (nibbles j and j + 4 of a step's WORDS words) is a
  [N, 2 * WORDS] operand whose column 2w + t is input 8w + j + 4t, and the activation tile
  is loaded in the same order, so the dot sums the products the GEMV needs, only in
  another order. Triton lays the pairs out as the MMA operand wants them (two consecutive K
  values a register): the words cross shared memory once a step as int32 (half a byte a
  code), the codes never;
- 128 + zero is not subtracted per code: a K step (which lies within one scale group) takes
  dot(128 + code, x) and subtracts (128 + zero) * sum(x) once per output, then multiplies by
  the scale. The products are exact in float32; the subtraction cancels the bias's share of
  the sums, ~136 / 4 of them with bf16 (BIAS + zero against a typical |code - zero|), ~1032
  / 4 with fp16, which costs 5 (8) of float32's 24 bits: the result keeps more than the
  output dtype's 8 (11).

Measured on an H100 (2026-12-07, tests/quantization/test_int4_mma_gemv.py; the best tile of
each kernel for Llama-3.1-8B's qkv, o, gate_up and down together): 61.1 us against the wide
kernel's 65.3 at 1 row, 63.9 against 83.5 at 2 rows, 67.4 against 202.2 at 8 rows; W2 batch 1
with INT4 g128 294.0 -> 310.6 tok/s. At one row the large projections stayed near 2 TB/s with
either kernel, and neither loading the next step's words first nor Triton's pipelining
(num_stages) helped (both slower). The sm_90 output showed why afterwards: each dot takes its
activation tile through shared memory behind a barrier, and ptxas moves no load across one,
so the activations loaded inside the pair-set loop and the scales loaded after the dots made
five global round trips a step in a row. The step now issues all its loads first (words,
activations, scales: one round trip), and the words load as 16-byte vectors (see below);
tests/quantization/test_int4_mma_sass.py checks both in the sm_90 output. The hoisted loads
did not move W2 (2026-12-07, one H100, back to back: 307.1 tok/s before, 306.6 after; the
vector loads were not measured apart), so what holds one row near 2 TB/s is still open. The
tiles read GPTQ's codes [K / 8, N] as runs of BLOCK_N * 4 bytes one N-row apart; `tiled`
reads tile_codes' layout, each step's tile one run. benchmarks/int4_read_probe.py
(2026-12-07, H100) found the layout itself costs nothing: read-only kernels over either
layout's tiles read alike (gate_up cold 2.7 TB/s on the best tiles), and L2-warm and cold
timings pick the same tiles. What the tiled kernel did gain was registers: one base pointer
where a runtime row stride kept a 64-bit pointer a row, 168 -> 128 at n256 w4, so four
programs share a multiprocessor where three fit. gate_up's best tile went 33.8 -> 28.1 us and
W2 INT4 317-327 -> 350.5 tok/s (pairs back to back; 1.00 of that through `shoal serve`). The
GPTQ layout now gets the same count from its row stride as a compile-time constant
(ROW_WORDS), with no second copy of the codes: W2 337.9 tok/s, the tiled copy 347.7 in the
same pair (H100; why the copy stays ahead is open). PDL (shoal/pdl.py, launched after the K loop)
gave 306.6 -> 317.7.

A K split over programs (SPLIT > 1) writes float32 partials [SPLIT, M, N]; the program that
finishes a strip last (a per-strip counter, reset by that program) adds them in split order
and writes the output, as int4_wide_gemv.py does.

Limits, checked by `fits`: x in bf16 or fp16 (the magic constant is the activations' type), K a
multiple of the step (8 * WORDS inputs, WORDS >= 8: the MMA's K of 16 bit operands is 16), and
the step dividing the group unless one group spans K."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shoal import envs, pdl
from shoal.attention.ops.interpreted_half import half_dot, to_dtype
from shoal.layers.quantization.k_split import k_split

# the packed pair's upper bits per activation dtype: exponent of 128 (bf16) / 1024 (fp16)
MAGIC = {torch.bfloat16: 0x4300, torch.float16: 0x6400}
BIAS = {torch.bfloat16: 128.0, torch.float16: 1024.0}
MAX_ROWS = 8  # the MMA's N: the activation rows a launch takes
# the tiled copy an Int4Linear keeps under SHOAL_INT4_TILED=1 (tile_codes): the widest tile
# of TILES, 16 words (one 128-wide group) a step
TILED_BLOCK_N, TILED_WORDS = 256, 16


@triton.jit
def _pairs(words2, SH: tl.constexpr, MAGIC16: tl.constexpr, INTERPRETED: tl.constexpr):
    """[..., 2] of x's dtype from words2 = join(words, words): the nibble at bit SH of each
    word (t = 0) and at bit SH + 16 (t = 1), each read as BIAS + code."""
    if INTERPRETED:  # the same values, in float32 (interpreted_half.half_dot widens them)
        code = ((words2 >> (SH + 16 * tl.arange(0, 2))) & 0xF).to(tl.float32)
        pairs = code + (128.0 if MAGIC16 == 0x4300 else 1024.0)
    elif MAGIC16 == 0x4300:
        pairs = tl.inline_asm_elementwise(
            asm=f"{{ .reg .b32 t; shr.b32 t, $1, {SH}; "
                "lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; }",
            constraints="=r,r,r", args=[words2], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        pairs = tl.inline_asm_elementwise(
            asm=f"{{ .reg .b32 t; shr.b32 t, $1, {SH}; "
                "lop3.b32 $0, t, 0x000F000F, 0x64006400, 0xEA; }",
            constraints="=r,r,r", args=[words2], dtype=tl.float16, is_pure=True, pack=2)
    return pairs  # (one return: Triton checks every return's type, taken or not)


@triton.jit
def _pair_set_dot(words2, x, SH: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
                  MAGIC16: tl.constexpr, INTERPRETED: tl.constexpr):
    """[BLOCK_N, 8] float32: the pair set at bit SH of words2 (_pairs, as a [BLOCK_N, 2 *
    WORDS] operand) times its activations x [2 * WORDS, 8]."""
    a = tl.reshape(_pairs(words2, SH, MAGIC16, INTERPRETED), (BLOCK_N, 2 * WORDS))
    return half_dot(a, x, "tf32", INTERPRETED)


@triton.jit
def _group_loads(s_ptr, z_ptr, g, safe_n, HAS_ZERO: tl.constexpr, BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Scales [BLOCK_N] and BIAS + zero points (float32) of the group at offset g."""
    scale = tl.load(s_ptr + g + safe_n).to(tl.float32)
    if HAS_ZERO:
        bias = BIAS + tl.load(z_ptr + g + safe_n).to(tl.float32)
    else:
        bias = tl.full([BLOCK_N], BIAS + 8.0, tl.float32)
    return scale, bias


@triton.jit
def _x_loads(x_ptrs):
    """The activations of a step's four pair sets, [2 * WORDS, 8] each."""
    return tl.load(x_ptrs), tl.load(x_ptrs + 1), tl.load(x_ptrs + 2), tl.load(x_ptrs + 3)


@triton.jit
def _step_sum(scale, bias, x0, x1, x2, x3, words, BLOCK_N: tl.constexpr,
              WORDS: tl.constexpr, MAGIC16: tl.constexpr, INTERPRETED: tl.constexpr):
    """[BLOCK_N, 8] float32: a step's share of the outputs: its group's scales and biases
    (_group_loads), activations (_x_loads) and words [BLOCK_N, WORDS]."""
    xsum = tl.sum(x0.to(tl.float32) + x1.to(tl.float32) + x2.to(tl.float32)
                  + x3.to(tl.float32), axis=0)  # [8]: the step's inputs summed
    words2 = tl.join(words, words)  # [BLOCK_N, WORDS, 2]: each word for both nibbles
    dots = _pair_set_dot(words2, x0, 0, BLOCK_N, WORDS, MAGIC16, INTERPRETED)
    dots += _pair_set_dot(words2, x1, 4, BLOCK_N, WORDS, MAGIC16, INTERPRETED)
    dots += _pair_set_dot(words2, x2, 8, BLOCK_N, WORDS, MAGIC16, INTERPRETED)
    dots += _pair_set_dot(words2, x3, 12, BLOCK_N, WORDS, MAGIC16, INTERPRETED)
    return (dots - bias[:, None] * xsum[None, :]) * scale[:, None]


@triton.jit
def _store_tile(acc, out_ptr, cells, ok, INTERPRETED: tl.constexpr):
    """acc [BLOCK_N, 8] -> out_ptr + cells where ok (rows < M, n < N of an [M, N] out)."""
    tl.store(out_ptr + cells, to_dtype(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=ok)


@triton.jit
def _int4_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                     K_SPLIT, SPLIT, stride_xm, stride_wk, stride_sg,
                     GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
                     WORDS: tl.constexpr, MAGIC16: tl.constexpr, BIAS: tl.constexpr,
                     SPLIT_K: tl.constexpr, INTERPRETED: tl.constexpr,
                     PDL: tl.constexpr = False, TILED: tl.constexpr = False,
                     ROW_WORDS: tl.constexpr = 0):
    # PDL: waits for the kernel before (it wrote x) before the first load, and lets the next
    # kernel in only after the K loop (it launches once every program has got there: its
    # start overlaps the stores and split sums; PDL from the start cost the INT4 strip
    # kernel 10%, pdl.py)
    pdl.wait_previous(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_n = tl.minimum(offs_n, N - 1)  # columns past N re-read the last one (not stored)
    rows = tl.arange(0, 8)  # activation rows: the MMA's columns
    safe_m = tl.minimum(rows, M - 1)  # rows past M re-read the last one (not stored)
    kk = tl.arange(0, 2 * WORDS)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    # the words by offs_n and a mask, not safe_n: through tl.minimum Triton no longer sees the
    # columns as contiguous, and loaded them as 4-byte words across 16 rows a warp (32
    # loads a thread a step at n256 w4, 209 registers) where 16-byte vectors along N do (8
    # loads, 167 registers; Triton 3.9's sm_90 output)
    if TILED:  # codes [strips, K / (8 * WORDS), WORDS, BLOCK_N]: a step's tile contiguous
        tile = (pid_n * (K // (8 * WORDS)) + k_start // (8 * WORDS)).to(tl.int64)
        w_ptrs = (w_ptr + tile * (WORDS * BLOCK_N) + tl.arange(0, WORDS)[None, :] * BLOCK_N
                  + tl.arange(0, BLOCK_N)[:, None])  # [BLOCK_N, WORDS]
        w_step = WORDS * BLOCK_N
    elif ROW_WORDS > 0:  # the codes' row stride known to the compiler: one base pointer
        w_ptrs = (w_ptr + (k_start // 8).to(tl.int64) * ROW_WORDS
                  + tl.arange(0, WORDS)[None, :] * ROW_WORDS + offs_n[:, None])
        w_step = WORDS * ROW_WORDS
    else:
        w_ptrs = (w_ptr + (k_start // 8 + tl.arange(0, WORDS)).to(tl.int64)[None, :]
                  * stride_wk + offs_n[:, None])  # [BLOCK_N, WORDS]
        w_step = WORDS * stride_wk
    n_ok = (offs_n < N)[:, None]
    x_row = x_ptr + safe_m.to(tl.int64)[None, :] * stride_xm + k_start
    # the activations of pair set j: row 2w + t of the tile is input 8w + j + 4t of the step
    x_ptrs = x_row + ((kk // 2) * 8 + (kk % 2) * 4)[:, None]  # [2 * WORDS, 8]
    acc = tl.zeros([BLOCK_N, 8], dtype=tl.float32)
    # every load of a step first, issued together: a load between two dots waits behind the
    # first one's barrier (a dot takes its operand through shared memory), and one after the
    # dots adds a round trip: five a step where one does. (Two steps' loads together, tried
    # 2026-12-07 in the sm_90 output: Triton converts a load's layout right after it, through
    # shared memory behind a barrier, and the second step's scales or words then load behind
    # the first's conversion, whatever the source order.)
    for k0 in range(k_start, k_end, 8 * WORDS):
        scale, bias = _group_loads(s_ptr, z_ptr, (k0 // GROUP) * stride_sg, safe_n, HAS_ZERO,
                                   BIAS, BLOCK_N)
        x0, x1, x2, x3 = _x_loads(x_ptrs)
        words = tl.load(w_ptrs, mask=n_ok, other=0)
        acc += _step_sum(scale, bias, x0, x1, x2, x3, words, BLOCK_N, WORDS, MAGIC16,
                         INTERPRETED)
        w_ptrs += w_step
        x_ptrs += 8 * WORDS
    pdl.launch_next(PDL)
    ok = (offs_n < N)[:, None] & (rows < M)[None, :]
    cells = rows[None, :].to(tl.int64) * N + offs_n[:, None]  # of an [M, N] tile
    if SPLIT_K:  # partials first; the count tells the strip's last program they are written
        _store_tile(acc, part_ptr + pid_k.to(tl.int64) * M * N, cells, ok, INTERPRETED)
        tl.debug_barrier()  # every thread's partial is written before the count goes up
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros([BLOCK_N, 8], dtype=tl.float32)
            for s in range(SPLIT):  # in split order: the same bits every launch
                total += tl.load(part_ptr + s * M * N + cells, mask=ok, other=0.0,
                                 cache_modifier=".cg")  # (at L2, where the others wrote them)
            _store_tile(total, out_ptr, cells, ok, INTERPRETED)
            tl.store(count_ptr + pid_n, 0)  # ready for the next launch
    else:
        _store_tile(acc, out_ptr, cells, ok, INTERPRETED)


# Launch candidates: (block_n, warps). Registers from Triton 3.9's sm_90 compiler at 16 words a
# step (no spills): n128 w4 102, n256 w4 168, n256 w8 96 (127, 209, 127 before the words loaded
# as vectors and the loads moved before the dots). On an H100 (2026-12-07, Llama-3.1-8B's
# projections, before the vector loads) the tuner picked each of the three somewhere between 1
# and 8 rows. Slower everywhere, so not offered: Triton's pipelining (num_stages 3, the words
# through cp.async), 1.5-2x; the next step's words loaded before this step's dots, 1.3-1.9x.
TILES = ((128, 4), (256, 4), (256, 8))


def launches(n: int, k: int, group: int, sms: int) -> list[tuple[int, int, int, int]]:
    """(block_n, words, split, num_warps) worth timing for codes [K / 8, N] of group `group`
    on a GPU of `sms` multiprocessors: 16 words a step (one 128-wide group), else 8 (64);
    per tile, the K splits (powers of two) nearest 2 and 4 programs a multiprocessor, at most
    half the steps (int4_mma_gemv recomputes a split that leaves programs without steps).
    None where no step fits (`step_fits`)."""
    words = next((w for w in (16, 8) if step_fits(k, group, w)), None)
    if words is None:
        return []
    most = 1 << (max(1, k // (8 * words) // 2).bit_length() - 1)
    out = []
    for block_n, warps in TILES:
        strips = triton.cdiv(n, block_n)
        splits = sorted({min(most, 1 << max(0, round(math.log2(per_sm * sms / strips))))
                         for per_sm in (2, 4)})
        out += [(block_n, words, split, warps) for split in splits]
    return out


def step_fits(k: int, group: int, words: int) -> bool:
    """Whether a step of `words` words (8 * words inputs: a power of two >= 8, the MMA's K
    of 16-bit operands) divides K and the group (unless one group spans K)."""
    step = 8 * words
    return (words >= 8 and words & (words - 1) == 0 and k % step == 0
            and (group >= k or group % step == 0))


def fits(x_dtype: torch.dtype, k: int, group: int, words: int) -> bool:
    """Whether the kernel takes activations of x_dtype (bf16, fp16), K inputs and this group
    at a step of `words` words."""
    return x_dtype in MAGIC and step_fits(k, group, words)


def tile_codes(codes: torch.Tensor, block_n: int, words: int) -> torch.Tensor:
    """GPTQ's codes int32 [K / 8, N] -> [N / block_n, K / (8 * words), words, block_n]: each
    step's [words, block_n] tile of a strip contiguous (int4_mma_gemv's `tiled`), an
    experiment's layout, not the engine's yet: whether a tile read as one run beats runs of
    block_n words one N-row apart is measured by benchmarks/int4_read_probe.py."""
    kw, n = codes.shape
    if n % block_n or kw % words:
        raise ValueError(f"tile_codes: codes {tuple(codes.shape)} do not split into "
                         f"[{words}, {block_n}] tiles")
    return (codes.view(kw // words, words, n // block_n, block_n).permute(2, 0, 1, 3)
            .contiguous())


def int4_mma_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None, group: int, *, block_n: int, words: int,
                  split: int, num_warps: int, num_stages: int,
                  tiled: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 8, bf16 or fp16), codes int32 [K / 8, N] (or, tiled, tile_codes's
    [N / block_n, K / (8 * words), words, block_n] of them), scales [G, N], zeros uint8
    [G, N] or None (8) -> [M, N] in x's dtype; split: programs per strip along K."""
    m, k = x.shape
    if tiled:
        if codes.dim() != 4 or codes.shape[1:] != (k // (8 * words), words, block_n) \
                or not codes.is_contiguous():
            raise ValueError(f"int4 mma GEMV: tiled codes {tuple(codes.shape)} are not "
                             f"tile_codes(codes, {block_n}, {words}) of K {k}")
        n = codes.shape[0] * block_n
    else:
        n = codes.shape[1]
    if (not tiled and (codes.shape[0] != k // 8 or codes.stride(1) != 1)) \
            or scales.shape[1] != n or x.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError(f"int4 mma GEMV: x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
                         f"scales {tuple(scales.shape)} do not fit (rows contiguous)")
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"int4 mma GEMV takes 1..{MAX_ROWS} rows, got {m}")
    if not fits(x.dtype, k, group, words):
        raise ValueError(f"int4 mma GEMV: x {x.dtype} (bf16 or fp16), K {k} and group {group} "
                         f"need a step of 8 x words ({words}: a power of two >= 8) dividing "
                         "both")
    if block_n < 16 or block_n & (block_n - 1) or split < 1:
        raise ValueError(f"int4 mma GEMV: block_n {block_n} (a power of two >= 16), split "
                         f"{split} (>= 1)")
    if zeros is not None and (zeros.shape != scales.shape or zeros.stride() != scales.stride()):
        raise ValueError("int4 mma GEMV: zeros must match scales in shape and strides")
    ks = k_split(x, n, k, 8 * words, split, block_n, "int4 mma GEMV")
    _int4_mma_kernel[(ks.strips, ks.split)](
        x, codes, scales, zeros if zeros is not None else scales, ks.out, ks.part, ks.count,
        m, n, k, ks.span, ks.split, x.stride(0), 0 if tiled else codes.stride(0),
        scales.stride(0),
        GROUP=group if group < k else 1 << 30, HAS_ZERO=zeros is not None, BLOCK_N=block_n,
        WORDS=words, MAGIC16=MAGIC[x.dtype], BIAS=BIAS[x.dtype], SPLIT_K=ks.split > 1,
        INTERPRETED=x.device.type == "cpu",  # (TRITON_INTERPRET=1)
        TILED=tiled, ROW_WORDS=0 if tiled else codes.stride(0),
        num_warps=num_warps, num_stages=num_stages,
        **(pdl.kwargs(x.device) if envs.SHOAL_INT4_PDL.get() else {}))
    return ks.out

"""MXFP4 experts at decode sizes, second form: the codes read as 4-byte words along K, one
word (8 codes) of each of a program's rows a thread a K step. A launch candidate beside
mxfp4_decode_experts.py's tiles (same contract, same two kernels; the tuner times both).

Why a second form (gpt-oss-20b on an H100 at T = 1: gate_up 52 us, down 26 us a layer
against 11 and 5.5 us of bytes at 3 TB/s). The first form's sm_90 code (tile n16g8, read
with bench-work/helpers/sass_mxfp4_decode.py) puts the 32 lanes of a warp on 32 rows,
each loading a 16-byte block of its row (32 sectors a load, each half used); the step's
x, scales and block sums change layout through shared memory (6 barriers a K step); and
the next step's loads are issued only after this step's sums, so a program waits out the
DRAM latency 12 times. Its K loop is 817 instructions a thread a step of 32 bytes of codes
(28 a byte with the code around it): issuing them alone takes 31 us for gate_up (132 SMs,
4 schedulers, 1.755 GHz), which is why it runs at ~5x the memory floor.

Here:
- tiles are [W, R]: W = 32 * num_warps words along K (lanes and warps), a program's R rows
  in each thread's registers. A warp's load is 128 contiguous bytes of a row. A thread's
  x is the 8 inputs of its word (one 16-byte load of bf16 / fp16) and its scale the
  byte of its word's block (the 4 threads of a block load the same byte), so codes,
  scales and x share one layout: no layout change and no barrier before the final sum.
  The words are loaded one a thread on purpose (8 codes is what one 16-byte x load
  covers); the strides are unspecialized so that Triton's coalescing, which widens loads
  to the divisibility it can prove, keeps them at one word.
- K is a constexpr and its steps are unrolled: each step's loads sit at fixed offsets
  from one pointer a row (no address arithmetic a step), only a part-filled last step is
  masked, and ptxas issues each step's loads about a step ahead of their use. Rows past
  the end read the last row (no row masks; their sums are not stored).
- a word's 8 codes become float16 bit patterns two at a time (the two halves of a 32-bit
  register: 12 integer instructions a word) and float32 by the half-to-float conversion
  (one instruction a code): e2m1 (sign, exponent bits e1 e0 with bias 1, mantissa bit m)
  placed at float16 bits 15 and 11..9 is exactly 2^-14 of its value, the subnormal code
  1 (0.5) included, since float16's exponent 0 is subnormal as e2m1's is. Sums are
  multiplied by 2^14 at the end; the block scale multiplies each word's 8 products once.
  With the loads, ~35 instructions a word (9 a byte); whole kernels 10-15 a byte of codes.
- down reads the k routed experts of its token slot by slot, the routing weight folded
  into the scale (a power of two times the weight: exact). No K split: one kernel writes
  the output in x's dtype.

Graph safety as the first form: grids and buffers follow from T, k and the tiles only; the
routing is read on the device."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal.layers.moe.activation import SILU, ExpertActivation
from shoal.layers.moe.mxfp4_decode_experts import check_experts_fit, store_gate_up_activation
from shoal.layers.moe.mxfp4_experts import Mxfp4Experts

TWO_POW_14 = tl.constexpr(16384.0)  # the float16 patterns hold 2^-14 of each e2m1 value
# _word_dot's masks, passed as run-time arguments (its docstring says why); int32 bits
LOW3 = 0x07070707
HALF = 0x8E008E00 - (1 << 32)


@dataclass(frozen=True)
class WordTiles:
    """gate_up: block_n outputs of I (and their up rows) a program; down: down_block_n
    outputs of H a program, over the token's k experts; 32 * num_warps words (256 inputs
    a warp) a K step."""

    block_n: int
    down_block_n: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "down_block_n", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"WordTiles.{name} must be a power of two, got {v}")

    @property
    def words(self) -> int:
        return 32 * self.num_warps

    @property
    def name(self) -> str:
        return f"words n{self.block_n} down n{self.down_block_n} w{self.num_warps}"


@triton.jit
def _halves_to_float(h):
    """float32 of the float16 bit patterns in the low and the high 16 bits of h (uint32)."""
    lo = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _word_dot(w, low3_mask, half_mask, x0, x1, x2, x3, x4, x5, x6, x7):
    """2^-14 * sum over i of e2m1(code i of w) * x_i, float32. w (uint32) holds the codes
    of inputs 8j .. 8j + 7, code i in bits 4i .. 4i + 3 (a byte's low nibble is the even
    input); low3_mask / half_mask are LOW3 / HALF (int32 arguments).

    A code's float16 pattern has its magnitude bits at 11..9 and its sign at 15. `even` /
    `odd` gather, in each byte, the magnitude of the even / odd code with its sign 6 bits
    above it (w << 3 brings a nibble's bit 3 to 6), so that one shift and one mask make
    the patterns of two codes, 16 bits apart; codes 3 and 7 (7's sign is bit 31) take
    theirs from w. The masks are not constants so that LLVM keeps these 32-bit operations
    whole: given constants, it narrows them to 16-bit halves and repacks the halves of
    different rows (~20 more instructions a word on sm_90)."""
    low3 = low3_mask.to(tl.uint32, bitcast=True)
    half = half_mask.to(tl.uint32, bitcast=True)
    w3 = w << 3
    even = (w & low3) | (w3 & ~low3)
    odd = (w & (low3 << 4)) | (w3 & ~(low3 << 4))
    sign = half & ~(low3 << 9)  # 0x80008000
    v0, v4 = _halves_to_float((even << 9) & half)
    v2, v6 = _halves_to_float((even << 1) & half)
    v1, v5 = _halves_to_float((odd << 5) & half)
    v3, v7 = _halves_to_float(((w & sign) | ((w >> 3) & ~sign)) & half)
    acc = v0 * x0
    acc = tl.fma(v1, x1, acc)
    acc = tl.fma(v2, x2, acc)
    acc = tl.fma(v3, x3, acc)
    acc = tl.fma(v4, x4, acc)
    acc = tl.fma(v5, x5, acc)
    acc = tl.fma(v6, x6, acc)
    return tl.fma(v7, x7, acc)


@triton.jit
def _step_sums(acc, codes, exps, x, factor, low3_mask, half_mask, W: tl.constexpr):
    """acc [W, R] + 2^-14 (x . w) * scale * factor for each word: codes / exps [W, R] (int32
    words, e8m0 bytes), x [8 W] (inputs 8w .. 8w + 7 for word w)."""
    # x[8 w + i] for i = 0 .. 7 as [W] vectors: splits of what a thread holds (no moves)
    even, odd = tl.split(tl.reshape(x.to(tl.float32), (W, 2, 2, 2)))  # [w, a, b, c]: 4a+2b+c
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    dot = _word_dot(codes.to(tl.uint32, bitcast=True), low3_mask, half_mask, x0[:, None],
                    x1[:, None], x2[:, None], x3[:, None], x4[:, None], x5[:, None],
                    x6[:, None], x7[:, None])
    # e8m0 s >= 1 is the float32 2^(s - 127): the exponent field alone (0 reads as 0)
    scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return tl.fma(dot, scale * factor, acc)


@triton.jit
def _row_sums(b_tile, s_tile, x_tile, factor, low3_mask, half_mask, K: tl.constexpr,
              W: tl.constexpr, R: tl.constexpr):
    """[W, R] float32 partial sums (2^-14 of them) of rows . x over all of K: b_tile /
    s_tile [W, R] pointers to word w of each row's codes / its block's scale, x_tile [8 W]
    to x's first 8 W inputs; the steps unrolled (the module docstring)."""
    acc = tl.zeros([W, R], dtype=tl.float32)
    offs_w = tl.arange(0, W)[:, None]
    offs_x = tl.arange(0, 8 * W)
    for step in tl.static_range((K + 8 * W - 1) // (8 * W)):
        if (step + 1) * 8 * W <= K:  # a whole step
            codes = tl.load(b_tile + step * W)
            exps = tl.load(s_tile + step * W // 4)
            x = tl.load(x_tile + step * 8 * W)
        else:  # the part-filled last: words past K read nothing (scale 0, x 0)
            ok = offs_w < K // 8 - step * W
            codes = tl.load(b_tile + step * W, mask=ok)
            exps = tl.load(s_tile + step * W // 4, mask=ok, other=0)
            x = tl.load(x_tile + step * 8 * W, mask=offs_x < K - step * 8 * W, other=0.0)
        acc = _step_sums(acc, codes, exps, x, factor, low3_mask, half_mask, W)
    return acc


# the code / scale strides are unspecialized: see the module docstring (one-word loads)
@triton.jit(do_not_specialize=["stride_be", "stride_bn", "stride_se", "stride_sn"])
def _gate_up_words_kernel(x_ptr, ids_ptr, b_ptr, s_ptr, bias_ptr, out_ptr, inter,
                          stride_xm, stride_be, stride_bn, stride_se, stride_sn,
                          stride_bias, stride_om, alpha, limit, low3_mask, half_mask,
                          K: tl.constexpr, TOPK: tl.constexpr, HAS_BIAS: tl.constexpr,
                          CLAMPED: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr):
    """act[pair, n] = activation(gate, up) as mxfp4_decode_experts._gate_up_kernel; b_ptr
    the codes as int32 words ([E, 2I, K / 8], strides in words), K the inputs H."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    # R = 2 BLOCK_N rows: (n, 0) the gate row n, (n, 1) the up row inter + n
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    half = tl.arange(0, 2)
    rows = tl.reshape(tl.minimum(offs_n, inter - 1)[:, None] + half[None, :] * inter,
                      (2 * BLOCK_N,))
    offs_w = tl.arange(0, W)[:, None]
    b_tile = (b_ptr + expert * stride_be) + (rows[None, :] * stride_bn + offs_w)
    s_tile = (s_ptr + expert * stride_se) + (rows[None, :] * stride_sn + offs_w // 4)
    x_tile = x_ptr + (pair // TOPK).to(tl.int64) * stride_xm + tl.arange(0, 8 * W)
    acc = _row_sums(b_tile, s_tile, x_tile, 1.0, low3_mask, half_mask, K, W, 2 * BLOCK_N)
    sums = tl.sum(acc, axis=0) * TWO_POW_14
    if HAS_BIAS:
        sums += tl.load(bias_ptr + expert * stride_bias + rows).to(tl.float32)
    store_gate_up_activation(sums, out_ptr + pair.to(tl.int64) * stride_om + offs_n, n_ok,
                             alpha, limit, BLOCK_N, CLAMPED)


@triton.jit(do_not_specialize=["stride_be", "stride_bn", "stride_se", "stride_sn"])
def _down_words_kernel(a_ptr, ids_ptr, w_ptr, b_ptr, s_ptr, bias_ptr, out_ptr, h_out,
                       stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_bias,
                       low3_mask, half_mask, K: tl.constexpr, TOPK: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr):
    """out[token, n] = sum over the token's k slots of weight * (act[pair] . w2[expert, n]
    (+ bias[expert, n])), in x's dtype; b_ptr the codes as int32 words ([E, H, I / 8]), K
    the inputs I."""
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < h_out
    rows = tl.minimum(offs_n, h_out - 1)
    offs_w = tl.arange(0, W)[:, None]
    acc = tl.zeros([W, BLOCK_N], dtype=tl.float32)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    # a run-time loop over the slots: one slot's unrolled steps keep enough loads in
    # flight, and unrolling the slots too made the sm_90 code 4x longer (~10 s to compile)
    for slot in range(TOPK):
        pair = token * TOPK + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        weight = tl.load(w_ptr + pair).to(tl.float32)
        b_tile = (b_ptr + expert * stride_be) + (rows[None, :] * stride_bn + offs_w)
        s_tile = (s_ptr + expert * stride_se) + (rows[None, :] * stride_sn + offs_w // 4)
        a_tile = a_ptr + pair.to(tl.int64) * stride_am + tl.arange(0, 8 * W)
        acc += _row_sums(b_tile, s_tile, a_tile, weight, low3_mask, half_mask, K, W,
                         BLOCK_N)
        if HAS_BIAS:
            total += tl.load(bias_ptr + expert * stride_bias + rows).to(tl.float32) * weight
    total += tl.sum(acc, axis=0) * TWO_POW_14
    tl.store(out_ptr + token.to(tl.int64) * h_out + offs_n,
             total.to(out_ptr.dtype.element_ty), mask=n_ok)


def words_fit(q: Mxfp4Experts) -> bool:
    """Whether both projections' codes can be read as int32 words: rows contiguous, and
    every row at a 4-byte address (the loader's contiguous stacks always are)."""
    return all(w.blocks.stride(2) == 1 and w.blocks.stride(1) % 4 == 0
               and w.blocks.stride(0) % 4 == 0 and w.blocks.data_ptr() % 4 == 0
               for w in (q.w13, q.w2))


@functools.cache
def word_tiles(tokens: int, h_out: int, inter: int, device: torch.device
               ) -> tuple[WordTiles, ...]:
    """Launch candidates, timed by the tuner beside mxfp4_decode_experts.decode_tiles'.
    GPU: 1, 2 or 4 warps (K steps of 256, 512, 1024 inputs: gpt-oss's 2880 in 12, 6 or 3,
    94% filled); gate_up 4 or 8 outputs (8 / 16 rows) a program, down 2 or 4. Fewer warps
    a program: each thread sums more of a row, so the sum over the program's threads at
    the end costs less a byte (sm_90, gpt-oss-20b: 10.2 / 11.4 / 13.6 instructions a byte
    of gate_up's codes at 1 / 2 / 4 warps); none of these spills (compile_sm90_mxfp4.py).
    The interpreter: one tile of few, large programs."""
    if device.type != "cuda":
        return (WordTiles(32, 64, num_warps=1),)
    return (WordTiles(4, 2, num_warps=1), WordTiles(4, 2, num_warps=2),
            WordTiles(8, 4, num_warps=2), WordTiles(4, 2, num_warps=4))


def experts_mxfp4_words(x: torch.Tensor, q: Mxfp4Experts, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, tiles: WordTiles,
                        w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None,
                        activation: ExpertActivation = SILU) -> torch.Tensor:
    """mxfp4_decode_experts.experts_mxfp4_decode's contract (its caller checked the inputs):
    x [T, H] rows contiguous, topk_ids / topk_weights [T, k], biases [E, 2I] / [E, H]
    -> [T, H] in x's dtype. ValueError where words_fit(q) does not hold."""
    t, k = topk_ids.shape
    inter, h = check_experts_fit(x, q)
    if not words_fit(q):
        raise ValueError("MXFP4 expert blocks must have contiguous rows at 4-byte addresses "
                         "for the word kernels")
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    # uint8 [E, N, K / 2] read as int32 [E, N, K / 8] (a view; strides in words)
    w13, w2 = q.w13.blocks.view(torch.int32), q.w2.blocks.view(torch.int32)
    _gate_up_words_kernel[(t * k, triton.cdiv(inter, tiles.block_n))](
        x, ids, w13, q.w13.scales, w13_bias if w13_bias is not None else x, act, inter,
        x.stride(0), w13.stride(0), w13.stride(1), q.w13.scales.stride(0),
        q.w13.scales.stride(1), w13_bias.stride(0) if w13_bias is not None else 0,
        act.stride(0), float(activation.alpha), float(activation.limit), LOW3, HALF,
        K=q.w13.in_features, TOPK=k, HAS_BIAS=w13_bias is not None,
        CLAMPED=activation.kind == "clamped_swiglu", BLOCK_N=tiles.block_n,
        W=tiles.words, num_warps=tiles.num_warps)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    _down_words_kernel[(t, triton.cdiv(h, tiles.down_block_n))](
        act, ids, weights, w2, q.w2.scales, w2_bias if w2_bias is not None else x, out, h,
        act.stride(0), w2.stride(0), w2.stride(1), q.w2.scales.stride(0),
        q.w2.scales.stride(1), w2_bias.stride(0) if w2_bias is not None else 0, LOW3, HALF,
        K=inter, TOPK=k, HAS_BIAS=w2_bias is not None, BLOCK_N=tiles.down_block_n,
        W=tiles.words, num_warps=tiles.num_warps)
    return out

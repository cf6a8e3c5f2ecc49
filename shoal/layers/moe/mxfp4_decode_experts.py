"""MXFP4 experts at decode sizes (a few tokens): two weight-streaming kernels that read each
routed pair's expert straight from its token's routing, without the grouped path's sort.

At batch 1 the grouped path (triton_experts_mxfp4.py) runs gpt-oss-20b's experts as about
37 launches: align.group_by_expert's chain of small torch ops (~27: scatter_add, cumsum, a
stable sort, searchsorted, ...), the clamped SwiGLU as PyTorch ops (7), two GEMMs whose
16-row tiles hold one real row, and the sum over the k slots. Each costs microseconds inside
a CUDA graph, against the ~18 us the layer's 4 experts take to read at 3 TB/s. Here:

- gate_up: one program per (pair, BLOCK_N outputs of I): the pair's expert is read from
  topk_ids, its BLOCK_N gate rows and the matching up rows (FusedMoE's w13: gate rows, then
  up rows) stream together over all of K, and the bias and the activation (SiLU-and-mul or
  gpt-oss's clamped SwiGLU) are applied in registers: act [T * k, I] in x's dtype, with
  gate and up rounded to x's dtype first, as the grouped path stores them.
- down: one program per (token, BLOCK_N outputs of H, K split): each K step reads the
  step's codes of all k routed experts of the token, scaled by their routing weights; the
  down bias (times the routing weight) is added by split 0. One split writes the output in
  x's dtype; more write float32 partials [split, T, H] that a third kernel adds in split
  order (deterministic, no atomics).

Both read the checkpoint's layout as it is (blocks [E, N, K / 2], scales [E, N, K / 32]): a
step is GROUPS blocks of 32 inputs, [rows, GROUPS, 16] bytes, so each thread loads whole
16-byte blocks. A code becomes a float without an integer-to-float conversion (about six
instructions, then one FMA with its input): its three magnitude bits are masked into the
exponent's low bits and the mantissa's top bit of 2^-3, which reads as a quarter of the e2m1
magnitude for exponent >= 1; min(f, 2f - 1/4) fixes the two subnormal codes (0 and 0.5);
the sign bit selects the negation, and the sums are multiplied by 4 at the end. The block
scale multiplies a block's 16-byte partial sum once. The products are float32 (no tensor
cores: a pair is one row).

Graph safety: grids and buffers follow from T, k and the tiles only; the routing is read on
the device."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal.layers.moe.activation import SILU, ExpertActivation
from shoal.layers.moe.mxfp4_experts import Mxfp4Experts

# bytes of one 32-value block; a constexpr: the GPU compiler refuses plain globals in a kernel
# (the interpreter reads them as Python values)
_BYTES = tl.constexpr(16)
MAX_TOKENS = 8  # decode rows up to which this path is a launch candidate


@dataclass(frozen=True)
class DecodeTiles:
    """gate_up: BLOCK_N outputs of I (and their up rows) a program, `groups` blocks of 32
    inputs a K step; down: BLOCK_N outputs of H a program, `down_groups` blocks a step,
    `split` programs along K."""

    block_n: int
    groups: int
    down_block_n: int
    down_groups: int
    split: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "groups", "down_block_n", "down_groups"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"DecodeTiles.{name} must be a power of two, got {v}")
        if not 1 <= self.split <= 64:
            raise ValueError(f"DecodeTiles.split must be in [1, 64], got {self.split}")

    @property
    def name(self) -> str:
        return (f"decode n{self.block_n}g{self.groups} down n{self.down_block_n}"
                f"g{self.down_groups}s{self.split} w{self.num_warps}")


@triton.jit
def _e2m1_quarter(packed, SHIFT: tl.constexpr):
    """A quarter of the e2m1 value of the code at bit SHIFT (0: low nibble, 4: high) of each
    byte (int32): magnitude bits e1 e0 m go to float32 bits 24..22 under the exponent of
    2^-3 (124 has its two low bits clear, so the or is an add): 2^(e - 3) (1 + m / 2), a
    quarter of the code's 2^(e - 1) (1 + m / 2) for e >= 1; e == 0 reads 1/8 and 3/16 where a
    quarter of its 0 and 0.5 is 0 and 1/8: 2f - 1/4, which is below f only there."""
    bits = ((packed << (22 - SHIFT)) & 0x01C00000) | 0x3E000000
    f = bits.to(tl.float32, bitcast=True)
    mag = tl.minimum(f, 2.0 * f - 0.25)
    return tl.where((packed & (8 << SHIFT)) != 0, -mag, mag)


@triton.jit
def _block_sums(x_ptr, b_rows, s_rows, row_ok, k0, k_end, GROUPS: tl.constexpr):
    """[R, GROUPS] float32: for each row (b_rows / s_rows: pointers to the row's codes and
    scales) and each of the step's GROUPS blocks (inputs k0 + 32 g ..), a quarter of the
    block's weights times x[k0 + 32 g ..], times the block's scale. Blocks at or past
    k_end (a whole number of blocks) read nothing and give 0."""
    offs_g = tl.arange(0, GROUPS)
    offs_j = tl.arange(0, _BYTES)
    g_ok = k0 + offs_g * 32 < k_end
    ok = row_ok[:, None] & g_ok[None, :]
    first = tl.multiple_of(k0 // 2, _BYTES)  # k0: whole blocks (16-byte vector loads)
    byte = first + offs_g[:, None] * _BYTES + offs_j[None, :]  # [GROUPS, 16]
    packed = tl.load(b_rows[:, None, None] + byte[None, :, :], mask=ok[:, :, None],
                     other=0).to(tl.int32)
    exps = tl.load(s_rows[:, None] + (k0 // 32 + offs_g)[None, :], mask=ok, other=0)
    # e8m0 s >= 1 is the float32 2^(s - 127): the exponent field alone (0 reads as 0)
    scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    offs_x = k0 + tl.arange(0, GROUPS * 32)
    x = tl.load(x_ptr + offs_x, mask=offs_x < k_end, other=0.0).to(tl.float32)
    x_even, x_odd = tl.split(tl.reshape(x, (GROUPS, _BYTES, 2)))  # low nibble: even input
    prod = tl.fma(_e2m1_quarter(packed, 0), x_even[None, :, :],
                  _e2m1_quarter(packed, 4) * x_odd[None, :, :])
    return tl.sum(prod, axis=2) * scale


@triton.jit
def store_gate_up_activation(sums, out, ok, alpha, limit, BLOCK_N: tl.constexpr,
                             CLAMPED: tl.constexpr):
    """gate_up's interleaved sums [2 * BLOCK_N] (gate, up pairs) -> the activation stored at
    out [BLOCK_N] (mask ok): rounded to out's dtype first, as the grouped path stores gate_up,
    then SiLU(gate) * up or GPT-OSS's clamped SwiGLU (both decode paths' epilogue)."""
    sums = sums.to(out.dtype.element_ty).to(tl.float32)
    gate, up = tl.split(tl.reshape(sums, (BLOCK_N, 2)))
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    else:
        act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out, act.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, b_ptr, s_ptr, bias_ptr, out_ptr, inter, k_in,
                    stride_xm, stride_be, stride_bn, stride_se, stride_sn, stride_bias,
                    stride_om, alpha, limit, TOPK: tl.constexpr, HAS_BIAS: tl.constexpr,
                    CLAMPED: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """act[pair, n] = activation(gate, up) for outputs n of this program's block, gate / up
    = the pair's token row of x . w13[expert, n (gate) / inter + n (up), :] (+ bias)."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    # rows [BLOCK_N, 2]: (n, 0) the gate row n, (n, 1) the up row inter + n
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, 2)
    rows = tl.reshape(offs_n[:, None] + half[None, :] * inter, (2 * BLOCK_N,))
    n_ok = offs_n < inter
    row_ok = tl.reshape(n_ok[:, None] & (half[None, :] < 2), (2 * BLOCK_N,))
    b_rows = b_ptr + expert * stride_be + rows.to(tl.int64) * stride_bn
    s_rows = s_ptr + expert * stride_se + rows.to(tl.int64) * stride_sn
    x_row = x_ptr + (pair // TOPK).to(tl.int64) * stride_xm
    acc = tl.zeros([2 * BLOCK_N, GROUPS], dtype=tl.float32)
    for k0 in range(0, k_in, GROUPS * 32):
        acc += _block_sums(x_row, b_rows, s_rows, row_ok, k0, k_in, GROUPS)
    sums = tl.sum(acc, axis=1) * 4.0
    if HAS_BIAS:
        sums += tl.load(bias_ptr + expert * stride_bias + rows, mask=row_ok,
                        other=0.0).to(tl.float32)
    store_gate_up_activation(sums, out_ptr + pair.to(tl.int64) * stride_om + offs_n, n_ok,
                             alpha, limit, BLOCK_N, CLAMPED)


@triton.jit(do_not_specialize=["t_rows"])  # T changes with the batch: one compile
def _down_kernel(a_ptr, ids_ptr, w_ptr, b_ptr, s_ptr, bias_ptr, out_ptr, h_out, k_in,
                 k_span, t_rows, stride_am, stride_be, stride_bn, stride_se, stride_sn,
                 stride_bias, TOPK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """out[split, token, n] = sum over the token's k slots of weight * (act[pair, K range] .
    w2[expert, n, K range] (+ bias[expert, n] in split 0)); out is [T, H] in x's dtype with
    one split, else float32 partials [split, T, H]."""
    token, pid_k = tl.program_id(0), tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < h_out
    k_start = pid_k * k_span
    k_end = tl.minimum(k_start + k_span, k_in)
    acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
    for k0 in range(k_start, k_end, GROUPS * 32):
        for slot in tl.static_range(TOPK):  # every slot's loads of a step in flight together
            pair = token * TOPK + slot
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            b_rows = b_ptr + expert * stride_be + offs_n.to(tl.int64) * stride_bn
            s_rows = s_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn
            weight = tl.load(w_ptr + pair).to(tl.float32)
            acc += _block_sums(a_ptr + pair.to(tl.int64) * stride_am, b_rows, s_rows, n_ok,
                               k0, k_end, GROUPS) * weight
    total = tl.sum(acc, axis=1) * 4.0
    if HAS_BIAS:
        first = (pid_k == 0).to(tl.float32)
        for slot in tl.static_range(TOPK):
            pair = token * TOPK + slot
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            bias = tl.load(bias_ptr + expert * stride_bias + offs_n, mask=n_ok, other=0.0)
            total += bias.to(tl.float32) * (tl.load(w_ptr + pair).to(tl.float32) * first)
    dst = out_ptr + (pid_k.to(tl.int64) * t_rows + token) * h_out + offs_n
    tl.store(dst, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["numel"])
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over s of part[s, i] in split order, cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def split_span(k_in: int, groups: int, split: int) -> tuple[int, int]:
    """(inputs a split covers, whole K steps; the splits that get any)."""
    step = groups * 32
    span = triton.cdiv(triton.cdiv(k_in, step), split) * step
    return span, triton.cdiv(k_in, span)


@functools.cache
def decode_tiles(tokens: int, h_out: int, inter: int, device: torch.device
                 ) -> tuple[DecodeTiles, ...]:
    """Launch candidates for `tokens` rows of experts with H = h_out outputs and I = inter
    intermediate values, the heuristic's pick first. GPU: 32 or 16 outputs a program; the
    down projection split along its I inputs until its programs come near 3 a
    multiprocessor (each split keeping >= 2 steps). The interpreter: one tile of few, large
    programs, split so that both down paths run."""
    if device.type != "cuda":
        return (DecodeTiles(64, 4, 64, 2, 2, num_warps=1),)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = []
    for block_n, groups in ((32, 4), (16, 8)):
        strips = tokens * triton.cdiv(h_out, block_n)
        steps = triton.cdiv(inter, groups * 32)
        split = 1
        while strips * split * 2 <= 3 * sms and steps // (split * 2) >= 2 and split < 16:
            split *= 2
        out.append(DecodeTiles(block_n, groups, block_n, groups, split))
    return tuple(out)


def check_experts_fit(x: torch.Tensor, q: Mxfp4Experts) -> tuple[int, int]:
    """(I, H) of q's experts; ValueError where w13 [2I, H] and w2 [H, I] do not fit x [T, H]
    (shared by the decode kernels of this file and mxfp4_decode_words.py)."""
    inter, h = q.w2.in_features, q.w2.out_features
    if q.w13.out_features != 2 * inter or q.w13.in_features != x.shape[1]:
        raise ValueError(f"MXFP4 experts w13 ({q.w13.out_features} x {q.w13.in_features}) "
                         f"and w2 ({h} x {inter}) do not fit x [{x.shape[0]}, {x.shape[1]}]")
    return inter, h


def experts_mxfp4_decode(x: torch.Tensor, q: Mxfp4Experts, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, tiles: DecodeTiles,
                         w13_bias: torch.Tensor | None = None,
                         w2_bias: torch.Tensor | None = None,
                         activation: ExpertActivation = SILU) -> torch.Tensor:
    """triton_experts_mxfp4.experts_triton_mxfp4's contract (its caller checked the inputs):
    x [T, H] rows contiguous, topk_ids / topk_weights [T, k], biases [E, 2I] / [E, H]
    -> [T, H] in x's dtype."""
    t, k = topk_ids.shape
    inter, h = check_experts_fit(x, q)
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    w13, w2 = q.w13, q.w2
    clamped = activation.kind == "clamped_swiglu"
    _gate_up_kernel[(t * k, triton.cdiv(inter, tiles.block_n))](
        x, ids, w13.blocks, w13.scales, w13_bias if w13_bias is not None else x, act,
        inter, w13.in_features, x.stride(0), w13.blocks.stride(0), w13.blocks.stride(1),
        w13.scales.stride(0), w13.scales.stride(1),
        w13_bias.stride(0) if w13_bias is not None else 0, act.stride(0),
        float(activation.alpha), float(activation.limit),
        TOPK=k, HAS_BIAS=w13_bias is not None, CLAMPED=clamped, BLOCK_N=tiles.block_n,
        GROUPS=tiles.groups, num_warps=tiles.num_warps)
    span, split = split_span(inter, tiles.down_groups, tiles.split)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, t, h, dtype=torch.float32,
                                              device=x.device)
    _down_kernel[(t, triton.cdiv(h, tiles.down_block_n), split)](
        act, ids, weights, w2.blocks, w2.scales, w2_bias if w2_bias is not None else x, part,
        h, inter, span, t, act.stride(0), w2.blocks.stride(0), w2.blocks.stride(1),
        w2.scales.stride(0), w2.scales.stride(1),
        w2_bias.stride(0) if w2_bias is not None else 0,
        TOPK=k, HAS_BIAS=w2_bias is not None, BLOCK_N=tiles.down_block_n,
        GROUPS=tiles.down_groups, num_warps=tiles.num_warps)
    if split > 1:
        block = 256 if x.device.type == "cpu" else 1024  # (the interpreter: few programs)
        _sum_splits_kernel[(triton.cdiv(t * h, block),)](part, out, t * h, SPLIT=split,
                                                          BLOCK=block, num_warps=4)
    return out

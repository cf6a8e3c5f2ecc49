"""The routed expert MLPs with MXFP4 experts kept packed (gpt-oss as released): the two grouped
GEMMs of triton_experts.py with the e2m1 codes and their e8m0 scales decoded in registers.

Weights: mxfp4_experts.Mxfp4Experts, each projection in the checkpoint's layout, rows first
(blocks uint8 [E, N, K / 2], scales uint8 [E, N, K / 32]). K is whole 32-value blocks (the
format's) and a K step (BLOCK_K = 64) covers whole blocks, so each step reads 32 bytes and 2
scales of an output (a step past the end of K is masked: K = 32 (2j + 1) ends in half of
one). Decoded in float32 (exact: e2m1 times a power of two), each tile is rounded to x's
dtype before tl.dot, as the dense path rounds its weights at load; an e8m0 scale of 0
(2^-127) reads as 0 here, a difference below 2^-124 of a weight.

The rest is the bf16 path's: pairs grouped by expert into blocks (align.py), the activation
(gpt-oss's clamped SwiGLU, activation.py) between the GEMMs, the biases in each GEMM's
epilogue and the routing weight in the second's, the LoRA hook after each, and graph safety:
the grid and every buffer are sized from T * k, E and the tile sizes only.

Decode sizes (T <= mxfp4_decode_experts.MAX_TOKENS, no LoRA) have a second path of two or
three launches instead of about 37 (mxfp4_decode_experts.py: no sort, the activation and the
sum over the k slots fused), in two forms: that module's tiles and the word kernels of
mxfp4_decode_words.py (codes read as 4-byte words along K). Which runs is
launch_tuner.run_fastest's pick per (shape, T): the GPU times this grouped path and every
decode tile of both forms once, outside CUDA-graph capture, and keeps the fastest of those
that agree with the grouped path's output; untimed (SHOAL_QUANT_TUNING=0, a first call
inside a capture) the GPU runs the grouped path, the interpreter (tests) the decode path's
first tiles."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from shoal.layers.moe.activation import SILU, ExpertActivation
from shoal.layers.moe.align import ExpertGroups, group_by_expert
from shoal.layers.moe.grouped_gemm_tile import store_tile, tile_expert, tile_pairs
from shoal.layers.moe.mxfp4_decode_experts import MAX_TOKENS, decode_tiles, experts_mxfp4_decode
from shoal.layers.moe.mxfp4_decode_words import experts_mxfp4_words, word_tiles, words_fit
from shoal.layers.moe.mxfp4_experts import Mxfp4Experts, Mxfp4Weights, dequantize_mxfp4_experts
from shoal.layers.moe.triton_experts import (
    check_quantized_inputs,
    choose_tiles,
    run_routed_experts,
)
from shoal.layers.quantization.launch_tuner import EXACT_OPERANDS_AGREE, run_fastest

BLOCK_K = 64  # the K step in every dtype: two 32-value blocks, 32 bytes and 2 scales a row


@triton.jit
def _e2m1_to_float(codes):
    """float32 values of 4-bit e2m1 codes (any integer tensor holding 0..15): sign bit, two
    exponent bits (bias 1), one mantissa bit; exponent 0 is subnormal (0 and 0.5)."""
    em = (codes & 7).to(tl.int32)
    # exponent e >= 1: 2^(e - 1) * (1 + m / 2) is float32 exponent e + 126, mantissa bit m
    normal = ((em << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    mag = tl.where(em >= 2, normal, em.to(tl.float32) * 0.5)
    return tl.where((codes & 8) != 0, -mag, mag)


# num_pairs changes every step: not specialized (== 1, % 16) so steps do not recompile.
@triton.jit(do_not_specialize=["num_pairs"])
def _mxfp4_grouped_gemm_kernel(
    a_ptr, b_ptr, s_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr, bias_ptr,
    num_pairs, n_out, k_in, a_row_div,
    stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_cm, stride_bias,
    MUL_WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """c[pair, n] = (a[pair // a_row_div, :] . w[expert, n, :] (+ bias[expert, n]))
    (* weights[pair]) for the pairs of one block, w decoded from b (blocks [E, N, K / 2]) and
    s (scales [E, N, K / 32]) one K step at a time."""
    pid_m, pid_n, expert = tile_expert(tl.program_id(0), n_out, block_expert_ptr, BLOCK_N)
    if expert < 0:  # padding block past the used ones
        return
    expert = expert.to(tl.int64)  # expert * stride_be passes 2**31 on large expert stacks
    pairs, valid, rows, offs_n, n_mask = tile_pairs(pid_m, pid_n, sorted_ids_ptr, num_pairs,
                                                    a_row_div, n_out, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)  # the step's bytes of one output
    offs_s = tl.arange(0, BLOCK_K // 32)  # and its scales
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = (b_ptr + expert * stride_be + offs_n[:, None].to(tl.int64) * stride_bn
              + offs_b[None, :])
    s_ptrs = (s_ptr + expert * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
              + offs_s[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        left = k_in - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < left)[None, :], other=0.0)
        packed = tl.load(b_ptrs, mask=n_mask[:, None] & (offs_b < left // 2)[None, :],
                         other=0)
        # [N, K / 2] bytes -> [N, K / 2, 2] (low nibble first) -> [N, K] codes in k order
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
        exps = tl.load(s_ptrs, mask=n_mask[:, None] & (offs_s < left // 32)[None, :],
                       other=0)
        # e8m0 s >= 1 is the float32 2^(s - 127): the exponent field alone (0 reads as 0)
        scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        w = tl.reshape(_e2m1_to_float(codes), (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(a.dtype)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 32
    store_tile(acc, c_ptr, stride_cm, pairs, valid, offs_n, n_mask, expert, bias_ptr,
               stride_bias, weights_ptr, HAS_BIAS, MUL_WEIGHTS)


def _gemm(a: torch.Tensor, w: Mxfp4Weights, c: torch.Tensor, groups: ExpertGroups,
          weights: torch.Tensor | None, num_pairs: int, a_row_div: int,
          tiles: tuple[int, int], bias: torch.Tensor | None = None) -> None:
    block_n, block_k = tiles  # block_k: a multiple of 32
    n_out = w.out_features
    grid = (groups.block_expert.shape[0] * triton.cdiv(n_out, block_n),)
    half = a.dtype != torch.float32
    _mxfp4_grouped_gemm_kernel[grid](
        a, w.blocks, w.scales, c, groups.sorted_ids, groups.block_expert,
        weights if weights is not None else c, bias if bias is not None else c,
        num_pairs, n_out, w.in_features, a_row_div,
        a.stride(0), w.blocks.stride(0), w.blocks.stride(1), w.scales.stride(0),
        w.scales.stride(1), c.stride(0), bias.stride(0) if bias is not None else 0,
        MUL_WEIGHTS=weights is not None, HAS_BIAS=bias is not None,
        BLOCK_M=groups.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="tf32" if half else "ieee",
        num_warps=4, num_stages=3 if half else 2,
    )


def _check_biases(q: Mxfp4Experts, w13_bias: torch.Tensor | None,
                  w2_bias: torch.Tensor | None) -> None:
    e = q.w13.blocks.shape[0]
    for bias, shape in ((w13_bias, (e, q.w13.out_features)), (w2_bias, (e, q.w2.out_features))):
        if bias is not None and (tuple(bias.shape) != shape or bias.stride(1) != 1):
            raise ValueError(f"expert bias {tuple(bias.shape)} must be {shape}, rows contiguous")


# experts_triton_mxfp4's `path`: forced (tests, benchmarks)
PATHS = ("grouped", "decode", "words")


def experts_triton_mxfp4(x: torch.Tensor, q: Mxfp4Experts, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, w13_bias: torch.Tensor | None = None,
                         w2_bias: torch.Tensor | None = None,
                         activation: ExpertActivation = SILU, lora: Any = None,
                         path: str | None = None) -> torch.Tensor:
    """triton_experts.experts_triton's contract with the weights of `q`: x [T, H],
    topk_weights / topk_ids [T, k], optional biases w13_bias [E, 2I] and w2_bias [E, H]
    -> [T, H] in x's dtype. path: None (the module docstring's choice), "grouped", or
    "decode" / "words" (that form's first tiles; T <= MAX_TOKENS without LoRA)."""
    check_quantized_inputs(x, q.w13.in_features, topk_weights, topk_ids)
    _check_biases(q, w13_bias, w2_bias)
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be None or one of {PATHS}, got {path!r}")
    t, k = topk_ids.shape
    if t == 0:
        return torch.zeros_like(x)
    extra = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
    if path == "grouped" or lora is not None or (path is None and t > MAX_TOKENS):
        return _grouped(x, q, topk_weights, topk_ids, lora=lora, **extra)
    if t > MAX_TOKENS:
        raise ValueError(f"path {path!r} takes 1..{MAX_TOKENS} tokens, got {t}")
    h, inter = q.w2.out_features, q.w2.in_features
    tiles = {c.name: c for c in decode_tiles(t, h, inter, x.device)}
    words = {c.name: c for c in word_tiles(t, h, inter, x.device)} if words_fit(q) else {}

    def run(name: str) -> torch.Tensor:
        if name == "grouped":
            return _grouped(x, q, topk_weights, topk_ids, **extra)
        if name in words:
            return experts_mxfp4_words(x, q, topk_weights, topk_ids, words[name], **extra)
        return experts_mxfp4_decode(x, q, topk_weights, topk_ids, tiles[name], **extra)

    if path == "decode":
        return run(next(iter(tiles)))
    if path == "words":
        if not words:
            raise ValueError("path 'words' needs MXFP4 blocks whose rows are contiguous "
                             "at 4-byte addresses")
        return run(next(iter(words)))
    key = ("mxfp4 experts", q.w13.blocks.shape[0], q.w13.out_features, q.w13.in_features,
           q.w2.out_features, k, t, x.dtype, w13_bias is not None, activation.kind,
           tuple(tiles), tuple(words))  # (the candidates themselves: a layer whose blocks
    # refuse words, or a card of another SM count, must not inherit a pick it cannot run)
    # On CUDA the grouped path comes first: the tuner checks the others against it, and
    # runs it untimed. The interpreter (tests) runs the decode path.
    names = ("grouped", *tiles, *words) if x.is_cuda else (*tiles, *words, "grouped")
    return run_fastest(key, names, run, x.device, EXACT_OPERANDS_AGREE)


def _grouped(x: torch.Tensor, q: Mxfp4Experts, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, w13_bias: torch.Tensor | None,
             w2_bias: torch.Tensor | None, activation: ExpertActivation,
             lora: Any = None) -> torch.Tensor:
    """The grouped GEMMs (the module docstring's first path)."""
    t, k = topk_ids.shape
    e, two_i, h = q.w13.blocks.shape[0], q.w13.out_features, q.w2.out_features
    n = t * k
    block_m, block_n, _ = choose_tiles(n, e, x.dtype)
    if not x.is_cuda:  # the interpreter: fewer, larger programs
        block_n = 128
    groups = group_by_expert(topk_ids, e, block_m)
    tiles = (block_n, BLOCK_K)
    return run_routed_experts(
        x, topk_weights, topk_ids, two_i, h,
        lambda a, c: _gemm(a, q.w13, c, groups, None, n, k, tiles, w13_bias),
        lambda a, c, w: _gemm(a, q.w2, c, groups, w, n, 1, tiles, w2_bias), activation, lora)


# ---- the plain PyTorch twin (tests) ----------------------------------------------------------

def experts_mxfp4_reference(x: torch.Tensor, q: Mxfp4Experts, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, w13_bias: torch.Tensor | None = None,
                            w2_bias: torch.Tensor | None = None,
                            activation: ExpertActivation = SILU) -> torch.Tensor:
    """experts_triton_mxfp4 in plain PyTorch, pair by pair (small shapes): the weights
    dequantized and rounded to x's dtype as the kernel rounds its tiles, float32 products,
    the same casts to x's dtype."""
    t, k = topk_ids.shape
    h = q.w2.out_features
    experts = topk_ids.reshape(-1).long()
    tokens = torch.arange(t * k, device=x.device) // k
    w13 = dequantize_mxfp4_experts(q.w13, x.dtype).float()[experts]
    w2 = dequantize_mxfp4_experts(q.w2, x.dtype).float()[experts]
    gate_up = torch.bmm(w13, x.float()[tokens][:, :, None])[:, :, 0]
    if w13_bias is not None:
        gate_up = gate_up + w13_bias.float()[experts]
    act = activation(gate_up.to(x.dtype))
    down = torch.bmm(w2, act.float()[:, :, None])[:, :, 0]
    if w2_bias is not None:
        down = down + w2_bias.float()[experts]
    down = (down * topk_weights.reshape(-1, 1).float()).to(x.dtype)
    return down.view(t, k, h).sum(dim=1)


"""The routed expert MLPs with INT4 weight-only experts kept packed (W4A16: GPTQ, AWQ and
compressed-tensors pack-quantized checkpoints, e.g. Kimi-K2 Thinking, Qwen3-30B-A3B-GPTQ-Int4):
triton_experts.py's two grouped GEMMs with the 4-bit codes dequantized in registers.

Weights (`Int4Experts`, held by FusedMoE when the fast path keeps a checkpoint's INT4 experts,
shoal/quantization/fast_path.py): each projection of every expert stacked in the dense W4A16
GEMM's layout (shoal/layers/quantization/w4a16_gemm.py), so that a K step reads words
contiguous along N:
- codes int32 [E, ceil(K / 8), N]: code k of output n at bits 4 (k % 8) of word [k // 8, n];
- scales [E, G, N], G = ceil(K / group) (float16 where that is exact, else float32);
- zeros uint8 [E, G, N], or None for a symmetric checkpoint (zero 8);
w[e, n, k] = scale[e, k // group, n] * (code - zero). A K step lies in one group (BLOCK_K
divides the group, or one group spans K: per channel), so one row of scales and zeros serves
it. The activations stay in x's dtype: the tile of w is rounded to it before tl.dot.

The rest is the bf16 path's: pairs grouped by expert into blocks (align.py), SiLU-and-mul (or
another activation) between the GEMMs, the biases in each GEMM's epilogue and the routing
weight in the second's, the LoRA hook after each, and graph safety: the grid and every buffer are
sized from T * k, E and the tile sizes only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from shoal.layers.moe.activation import SILU, ExpertActivation
from shoal.layers.moe.align import ExpertGroups, group_by_expert
from shoal.layers.moe.grouped_gemm_tile import store_tile, tile_expert, tile_pairs
from shoal.layers.moe.triton_experts import (
    check_quantized_inputs,
    choose_tiles,
    run_routed_experts,
)
from shoal.layers.quantization.w4a16_gemm import block_k_for


@dataclass
class Int4Weights:
    """One projection of every expert (module docstring's layout)."""

    codes: torch.Tensor  # int32 [E, ceil(K / 8), N]
    scales: torch.Tensor  # float16 / float32 [E, G, N]
    zeros: torch.Tensor | None  # uint8 [E, G, N]; None: symmetric (8)
    group: int  # inputs per scale row; >= in_features: per channel
    in_features: int  # K

    @property
    def out_features(self) -> int:
        return self.codes.shape[2]

    @property
    def block_k(self) -> int:
        """The K step: one group's scales serve it (w4a16_gemm.block_k_for)."""
        return block_k_for(min(self.group, self.in_features), self.in_features)


@dataclass
class Int4Experts:
    """A FusedMoE's experts in INT4: w13 ([E, 2I] outputs: gate rows, then up rows, of H
    inputs) and w2 (H outputs of I inputs)."""

    w13: Int4Weights
    w2: Int4Weights

    @property
    def name(self) -> str:
        w = self.w13
        group = "channel" if w.group >= w.in_features else f"g{w.group}"
        kind = "sym" if w.zeros is None and self.w2.zeros is None else "asym"
        return f"int4 experts {group} {kind} (Triton W4A16)"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers().values())

    def buffers(self) -> dict[str, torch.Tensor]:
        """The tensors FusedMoE registers, by buffer name."""
        out = {}
        for which, w in (("w13", self.w13), ("w2", self.w2)):
            out[f"{which}_qweight"], out[f"{which}_scales"] = w.codes, w.scales
            if w.zeros is not None:
                out[f"{which}_qzeros"] = w.zeros
        return out


def int4_weights(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 in_features: int) -> Int4Weights:
    """From the loader's rows-first stacks (shoal/quantization/packed.py's "int4" parts, one
    per expert): codes int32 [E, N, ceil(K / 8)], scale [E, N, G], zero [E, N, G] (any
    integer dtype; all 8: symmetric). ValueError (a short reason) where the kernel cannot
    take them."""
    e, n, words = codes.shape
    k = in_features
    groups = -(-k // group) if group < k else 1
    if codes.dtype != torch.int32 or words != -(-k // 8):
        raise ValueError(f"int4 codes {tuple(codes.shape)} {codes.dtype}: need int32 "
                         f"[E, N, {-(-k // 8)}]")
    if tuple(scale.shape) != (e, n, groups) or tuple(zero.shape) != (e, n, groups):
        raise ValueError(f"int4 scales {tuple(scale.shape)} / zeros {tuple(zero.shape)}: "
                         f"need [{e}, {n}, {groups}] (group {group} of {k} inputs)")
    block_k_for(min(group, k), k)  # raises for a group that is not a multiple of 16
    if int(zero.min()) < 0 or int(zero.max()) > 15:
        raise ValueError("int4 zero points outside 0..15")
    s = scale.float()
    half = s.half()
    exact = bool(torch.isfinite(half).all()) and torch.equal(half.float(), s)
    return Int4Weights(_outputs_last(codes), _outputs_last(half if exact else s),
                       None if bool((zero == 8).all()) else _outputs_last(zero.to(torch.uint8)),
                       min(group, k), k)


def _outputs_last(t: torch.Tensor) -> torch.Tensor:
    """[E, N, C] -> contiguous [E, C, N], one expert at a time (no second copy of the stack)."""
    out = torch.empty(t.shape[0], t.shape[2], t.shape[1], dtype=t.dtype, device=t.device)
    for e in range(t.shape[0]):
        out[e] = t[e].t()
    return out


# num_pairs changes every step: not specialized (== 1, % 16) so steps do not recompile.
@triton.jit(do_not_specialize=["num_pairs"])
def _int4_grouped_gemm_kernel(
    a_ptr, b_ptr, s_ptr, z_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr,
    bias_ptr, num_pairs, n_out, k_in, a_row_div, group,
    stride_am, stride_be, stride_bk, stride_se, stride_sg, stride_cm, stride_bias,
    HAS_ZERO: tl.constexpr, MUL_WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """c[pair, n] = (a[pair // a_row_div, :] . w[expert, n, :] (+ bias[expert, n]))
    (* weights[pair]) for the pairs of one block, w dequantized from b (codes [E, K / 8, N]),
    s (scales [E, G, N]) and z (zeros, same strides as s) one K step at a time."""
    pid_m, pid_n, expert = tile_expert(tl.program_id(0), n_out, block_expert_ptr, BLOCK_N)
    if expert < 0:  # padding block past the used ones
        return
    expert = expert.to(tl.int64)  # expert * stride_be passes 2**31 on large expert stacks
    pairs, valid, rows, offs_n, n_mask = tile_pairs(pid_m, pid_n, sorted_ids_ptr, num_pairs,
                                                    a_row_div, n_out, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    shifts = ((offs_k % 8) * 4)[:, None]
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_base = b_ptr + expert * stride_be + offs_n[None, :]
    s_base = s_ptr + expert * stride_se + offs_n
    z_base = z_ptr + expert * stride_se + offs_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_mask = offs_k < k_in - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        words = tl.load(b_base + ((k0 + offs_k) // 8).to(tl.int64)[:, None] * stride_bk,
                        mask=k_mask[:, None] & n_mask[None, :], other=0)
        codes = (words >> shifts) & 0xF
        g = (k0 // group).to(tl.int64) * stride_sg
        scale = tl.load(s_base + g, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_base + g, mask=n_mask, other=0).to(tl.int32)
            w = (codes - zero[None, :]).to(tl.float32) * scale[None, :]
        else:
            w = (codes - 8).to(tl.float32) * scale[None, :]
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
    store_tile(acc, c_ptr, stride_cm, pairs, valid, offs_n, n_mask, expert, bias_ptr,
               stride_bias, weights_ptr, HAS_BIAS, MUL_WEIGHTS)


def _gemm(a: torch.Tensor, w: Int4Weights, c: torch.Tensor, groups: ExpertGroups,
          weights: torch.Tensor | None, num_pairs: int, a_row_div: int, block_n: int,
          bias: torch.Tensor | None = None) -> None:
    n_out = w.out_features
    grid = (groups.block_expert.shape[0] * triton.cdiv(n_out, block_n),)
    half = a.dtype != torch.float32
    _int4_grouped_gemm_kernel[grid](
        a, w.codes, w.scales, w.zeros if w.zeros is not None else w.scales, c,
        groups.sorted_ids, groups.block_expert, weights if weights is not None else c,
        bias if bias is not None else c,
        num_pairs, n_out, w.in_features, a_row_div, w.group,
        a.stride(0), w.codes.stride(0), w.codes.stride(1), w.scales.stride(0),
        w.scales.stride(1), c.stride(0), bias.stride(0) if bias is not None else 0,
        HAS_ZERO=w.zeros is not None, MUL_WEIGHTS=weights is not None,
        HAS_BIAS=bias is not None, BLOCK_M=groups.block_m, BLOCK_N=block_n,
        BLOCK_K=w.block_k, DOT_PRECISION="tf32" if half else "ieee",
        num_warps=4, num_stages=3 if half else 2,
    )


def experts_triton_int4(x: torch.Tensor, q: Int4Experts, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None,
                        activation: ExpertActivation = SILU, lora: Any = None) -> torch.Tensor:
    """triton_experts.experts_triton's contract with the weights of `q`: x [T, H],
    topk_weights / topk_ids [T, k] -> [T, H] in x's dtype."""
    check_quantized_inputs(x, q.w13.in_features, topk_weights, topk_ids)
    t, k = topk_ids.shape
    e, two_i, h = q.w13.codes.shape[0], q.w13.out_features, q.w2.out_features
    if t == 0:
        return torch.zeros_like(x)
    n = t * k
    block_m, block_n, _ = choose_tiles(n, e, x.dtype)
    if not x.is_cuda:  # the interpreter: fewer, larger programs
        block_n = 128
    groups = group_by_expert(topk_ids, e, block_m)
    return run_routed_experts(
        x, topk_weights, topk_ids, two_i, h,
        lambda a, c: _gemm(a, q.w13, c, groups, None, n, k, block_n, w13_bias),
        lambda a, c, w: _gemm(a, q.w2, c, groups, w, n, 1, block_n, w2_bias), activation, lora)


# ---- the plain PyTorch twin (tests, and the dense fallback) ---------------------------------

def dequantize_int4_experts(w: Int4Weights) -> torch.Tensor:
    """float32 [E, N, K] from one projection's packed stack."""
    k = w.in_features
    shifts = torch.arange(8, device=w.codes.device, dtype=torch.int32).view(1, 1, 8, 1) * 4
    codes = ((w.codes.unsqueeze(2) >> shifts) & 15).flatten(1, 2)[:, :k]  # [E, K, N]
    g = torch.arange(k, device=codes.device) // w.group
    zero = 8 if w.zeros is None else w.zeros.to(torch.int32)[:, g]
    return ((codes - zero).float() * w.scales.float()[:, g]).transpose(1, 2).contiguous()


def experts_int4_reference(x: torch.Tensor, q: Int4Experts, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, w13_bias: torch.Tensor | None = None,
                           w2_bias: torch.Tensor | None = None,
                           activation: ExpertActivation = SILU) -> torch.Tensor:
    """experts_triton_int4 in plain PyTorch, pair by pair (small shapes): the weights
    dequantized and rounded to x's dtype as the kernel rounds its tiles, float32 products,
    the same casts to x's dtype."""
    t, k = topk_ids.shape
    h = q.w2.out_features
    experts = topk_ids.reshape(-1).long()
    tokens = torch.arange(t * k, device=x.device) // k
    w13 = dequantize_int4_experts(q.w13).to(x.dtype).float()[experts]
    w2 = dequantize_int4_experts(q.w2).to(x.dtype).float()[experts]
    gate_up = torch.bmm(w13, x.float()[tokens][:, :, None])[:, :, 0]
    if w13_bias is not None:
        gate_up = gate_up + w13_bias.float()[experts]
    act = activation(gate_up.to(x.dtype))
    down = torch.bmm(w2, act.float()[:, :, None])[:, :, 0]
    if w2_bias is not None:
        down = down + w2_bias.float()[experts]
    down = (down * topk_weights.reshape(-1, 1).float()).to(x.dtype)
    return down.view(t, k, h).sum(dim=1)

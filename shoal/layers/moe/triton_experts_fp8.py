"""The routed expert MLPs with FP8 (e4m3) weights kept in FP8: triton_experts.py's two grouped
GEMMs, each with FP8 activations and weights and their scales applied in the K loop.

Weights (`FP8Experts`, held by FusedMoE when the fast path keeps a checkpoint's FP8 experts,
shoal/quantization/fast_path.py):
- block-scaled (DeepSeek-V3, Qwen3 "-FP8": weight_block_size [128, 128]): one float32 scale
  per tile of scale_rows x group weights, [E, ceil(N / scale_rows), ceil(K / group)]
  (scale_rows 128, or 1 where a tensor-parallel slice does not align the tiles); the
  activations are quantized per token and group of `group` inputs, so each K step of the
  GEMM is one group: its FP8 product accumulates in float32 times the two scales.
- per channel or per tensor (compressed-tensors float-quantized, online FP8): one scale per
  output row [E, N, 1] (group None), activations per token, or by the checkpoint's static
  scale (the largest over the experts, as a fused dense layer takes it); both scales apply
  once, after the K loop.

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
from shoal.layers.quantization.fp8_quant import (
    quantize_fp8_groups,
    quantize_fp8_groups_reference,
    quantize_fp8_static,
)

TILE_ROWS = 128  # checkpoints' block height: scales kept one per tile where the rows align
PER_ROW_BLOCK_K = 128  # the K step of per-row-scaled weights (any: no scale changes along K)


@dataclass
class FP8Experts:
    """A FusedMoE's experts in FP8. w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]
    float8_e4m3fn; their scales float32 as the module docstring says; input scales 0-d
    float32 (static activations) or None (quantized at run time)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    group: int | None  # block K width = activation group; None: per-row weight scales
    scale_rows13: int = 1
    scale_rows2: int = 1
    input_scale13: torch.Tensor | None = None
    input_scale2: torch.Tensor | None = None

    @property
    def name(self) -> str:
        if self.group is None:
            acts = "static" if self.input_scale13 is not None else "per token"
            return f"fp8 experts per-channel, activations {acts} (Triton)"
        return f"fp8 experts block {self.scale_rows13}x{self.group} (Triton)"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.w13, self.w13_scale, self.w2, self.w2_scale))


def _tile_rows(scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Per-row scales [E, N, G] -> one row per tile of TILE_ROWS rows where they are constant
    over each tile, else unchanged (scale_rows 1)."""
    n = scale.shape[1]
    if n % TILE_ROWS == 0:
        tiles = scale[:, ::TILE_ROWS]
        if torch.equal(scale, tiles.repeat_interleave(TILE_ROWS, 1)):
            return tiles.contiguous(), TILE_ROWS
    return scale.contiguous(), 1


def _static(input_scale: torch.Tensor | None) -> torch.Tensor | None:
    """The largest of the experts' static activation scales (no clipping); None where NaN
    (dynamic) or absent."""
    if input_scale is None or bool(torch.isnan(input_scale).any()):
        return None
    return input_scale.max().float()


def make_fp8_experts(w13: torch.Tensor, s13: torch.Tensor, group13: int, w2: torch.Tensor,
                     s2: torch.Tensor, group2: int, in13: torch.Tensor | None = None,
                     in2: torch.Tensor | None = None) -> FP8Experts:
    """From per-row scales ([E, N, ceil(K / group)]: a tile's scale repeated over its rows;
    [E, N, 1] with group >= K: per channel or per tensor) and optional static input scales
    [E, N, 1] (NaN: dynamic). ValueError (a short reason) where the kernel cannot take them."""
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError("weights are not float8_e4m3fn")
    static13, static2 = _static(in13), _static(in2)
    if group13 >= w13.shape[2] and group2 >= w2.shape[2]:  # one scale per row
        if (static13 is None) != (static2 is None):
            raise ValueError("static activation scales on one projection only")
        return FP8Experts(w13.contiguous(), s13.float().contiguous(), w2.contiguous(),
                          s2.float().contiguous(), None, 1, 1, static13, static2)
    group = group13
    if group2 != group or group < 16 or group > 256 or group & (group - 1):
        raise ValueError(f"block widths {group13} / {group2}: need one power of two in "
                         "[16, 256]")
    if s13.shape[2] != -(-w13.shape[2] // group) or s2.shape[2] != -(-w2.shape[2] // group):
        raise ValueError("the two projections' scales are not both per block")
    if static13 is not None or static2 is not None:
        raise ValueError("block scales with static activation scales")
    t13, rows13 = _tile_rows(s13.float())
    t2, rows2 = _tile_rows(s2.float())
    return FP8Experts(w13.contiguous(), t13, w2.contiguous(), t2, group, rows13, rows2)


# num_pairs changes every step: not specialized (== 1, % 16) so steps do not recompile.
@triton.jit(do_not_specialize=["num_pairs"])
def _fp8_grouped_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr,
    bias_ptr, num_pairs, n_out, k_in, a_row_div, scale_rows,
    stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse, stride_bsn,
    stride_bsk, stride_cm, stride_bias,
    K_SCALED: tl.constexpr, MUL_WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[pair, n] = (sum_g a_s[row, g] b_s[e, n // scale_rows, g] (a[row, K_g] . b[e, n, K_g])
    (+ bias[e, n])) (* weights[pair]), row = pair // a_row_div, for the pairs of one block.
    a float8 [*, K], b float8 [E, N, K]; K_SCALED: the scales change every BLOCK_K inputs
    (a block), else one per row of each, applied after the loop."""
    pid_m, pid_n, expert = tile_expert(tl.program_id(0), n_out, block_expert_ptr, BLOCK_N)
    if expert < 0:  # padding block past the used ones
        return
    expert = expert.to(tl.int64)  # expert * stride_be passes 2**31 on large expert stacks
    pairs, valid, rows, offs_n, n_mask = tile_pairs(pid_m, pid_n, sorted_ids_ptr, num_pairs,
                                                    a_row_div, n_out, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = (b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
              + offs_k[:, None])
    as_ptrs = as_ptr + rows * stride_asm
    bs_ptrs = bs_ptr + expert * stride_bse + (offs_n // scale_rows).to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(k_in, BLOCK_K)):
        k_mask = offs_k < k_in - g * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if K_SCALED:
            a_s = tl.load(as_ptrs + g * stride_ask, mask=valid, other=0.0)
            b_s = tl.load(bs_ptrs + g * stride_bsk, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not K_SCALED:
        a_s = tl.load(as_ptrs, mask=valid, other=0.0)
        b_s = tl.load(bs_ptrs, mask=n_mask, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    store_tile(acc, c_ptr, stride_cm, pairs, valid, offs_n, n_mask, expert, bias_ptr,
               stride_bias, weights_ptr, HAS_BIAS, MUL_WEIGHTS)


def quantize_activations(x: torch.Tensor, group: int | None,
                         static: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scales [M, ceil(K / group)] or [M, 1]: per token,
    or the static scale broadcast, stride 0)."""
    if static is not None:
        return quantize_fp8_static(x, static), static.reshape(1, 1).expand(x.shape[0], 1)
    return quantize_fp8_groups(x, group or x.shape[1])


def _gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
          scale_rows: int, c: torch.Tensor, groups: ExpertGroups, weights: torch.Tensor | None,
          num_pairs: int, a_row_div: int, group: int | None,
          bias: torch.Tensor | None = None) -> None:
    n_out, k_in = b.shape[1], b.shape[2]
    block_n = 64 if a.is_cuda else 128  # the interpreter: fewer, larger programs
    grid = (groups.block_expert.shape[0] * triton.cdiv(n_out, block_n),)
    _fp8_grouped_gemm_kernel[grid](
        a, a_scale, b, b_scale, c, groups.sorted_ids, groups.block_expert,
        weights if weights is not None else c, bias if bias is not None else c,
        num_pairs, n_out, k_in, a_row_div, scale_rows,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), b.stride(0), b.stride(1),
        b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), c.stride(0),
        bias.stride(0) if bias is not None else 0,
        K_SCALED=group is not None, MUL_WEIGHTS=weights is not None,
        HAS_BIAS=bias is not None, BLOCK_M=groups.block_m, BLOCK_N=block_n,
        BLOCK_K=group or PER_ROW_BLOCK_K, num_warps=4, num_stages=3,
    )


def experts_triton_fp8(x: torch.Tensor, q: FP8Experts, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, w13_bias: torch.Tensor | None = None,
                       w2_bias: torch.Tensor | None = None,
                       activation: ExpertActivation = SILU, lora: Any = None) -> torch.Tensor:
    """triton_experts.experts_triton's contract with the weights of `q`: x [T, H],
    topk_weights / topk_ids [T, k] -> [T, H] in x's dtype."""
    check_quantized_inputs(x, q.w13.shape[2], topk_weights, topk_ids)
    t, k = topk_ids.shape
    e, two_i, h = q.w13.shape
    if t == 0:
        return torch.zeros_like(x)
    n = t * k
    groups = group_by_expert(topk_ids, e, choose_tiles(n, e, x.dtype)[0])
    # each GEMM's input quantized per token group first (static scales where q has them)
    return run_routed_experts(
        x, topk_weights, topk_ids, two_i, h,
        lambda a, c: _gemm(*quantize_activations(a, q.group, q.input_scale13), q.w13,
                           q.w13_scale, q.scale_rows13, c, groups, None, n, k, q.group,
                           w13_bias),
        lambda a, c, w: _gemm(*quantize_activations(a, q.group, q.input_scale2), q.w2,
                              q.w2_scale, q.scale_rows2, c, groups, w, n, 1, q.group, w2_bias),
        activation, lora)


# ---- the plain PyTorch twin (tests) ----------------------------------------------------------

def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, scale_rows: int,
                       group: int | None) -> torch.Tensor:
    """float32 [E, N, K] from FP8 weights and their scales in FP8Experts' layout."""
    n, k = w.shape[1], w.shape[2]
    s = scale.float().repeat_interleave(scale_rows, 1)[:, :n]
    if group is not None and s.shape[2] > 1:
        s = s.repeat_interleave(group, 2)[:, :, :k]
    return w.float() * s


def fp8_rounded(x: torch.Tensor, group: int | None,
                static: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] as the kernel sees it: through FP8 (per token and group of `group` inputs,
    per token for None, or by the static scale) and back, in float32."""
    if static is not None:
        return quantize_fp8_static(x, static).float() * static
    g = group or x.shape[1]
    q, s = quantize_fp8_groups_reference(x, g)
    return q.float() * s.repeat_interleave(g, 1)[:, :x.shape[1]]


def experts_fp8_reference(x: torch.Tensor, q: FP8Experts, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, w13_bias: torch.Tensor | None = None,
                          w2_bias: torch.Tensor | None = None,
                          activation: ExpertActivation = SILU) -> torch.Tensor:
    """experts_triton_fp8 in plain PyTorch, pair by pair (small shapes): the activations
    rounded to FP8 the same way, the weights dequantized, float32 products, the same casts to
    x's dtype."""
    t, k = topk_ids.shape
    h = q.w13.shape[2]
    experts = topk_ids.reshape(-1).long()
    tokens = torch.arange(t * k, device=x.device) // k
    w13 = dequantize_experts(q.w13, q.w13_scale, q.scale_rows13, q.group)[experts]
    w2 = dequantize_experts(q.w2, q.w2_scale, q.scale_rows2, q.group)[experts]
    xr = fp8_rounded(x, q.group, q.input_scale13)[tokens]
    gate_up = torch.bmm(w13, xr[:, :, None])[:, :, 0]
    if w13_bias is not None:
        gate_up = gate_up + w13_bias.float()[experts]
    act = activation(gate_up.to(x.dtype))
    down = torch.bmm(w2, fp8_rounded(act, q.group, q.input_scale2)[:, :, None])[:, :, 0]
    if w2_bias is not None:
        down = down + w2_bias.float()[experts]
    down = (down * topk_weights.reshape(-1, 1).float()).to(x.dtype)
    return down.view(t, k, h).sum(dim=1)


"""The routed expert MLPs as two grouped GEMMs on the GPU.

Pairs (token, slot) are grouped by expert and padded to whole blocks of BLOCK_M rows
(align.py); one program computes a BLOCK_M x BLOCK_N tile of one block, so every row of a
tile uses the same expert's weights and the product is a plain tl.dot. The first GEMM gathers
token rows of x and writes gate_up per pair; SiLU-and-mul follows; the second GEMM reads the
pair rows, scales them by the routing weight and writes per pair; a sum over the k slots gives
each token's output (no atomics, so results are deterministic). Per-expert biases (gpt-oss) are
added in the GEMMs, before the routing weight; an activation other than SiLU-and-mul
(activation.py) runs as PyTorch ops on the pair rows. FusedMoE's LoRA hook (layer.py) adds
its deltas to the pair rows after each GEMM.

Graph safety: the grid and every buffer are sized from T * k, E and the tile sizes only (the
worst-case padding), and unused tail blocks are marked with expert -1 and exit at once, so
a captured decode step replays correctly with any routing.

fp16 / bf16 at a few tokens have a launch candidate beside these GEMMs: the decode kernels of
half_decode_experts.py (experts_triton's docstring says which runs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from shoal.layers.moe.activation import SILU, ExpertActivation
from shoal.layers.moe.align import ExpertGroups, group_by_expert
from shoal.layers.moe.expert_inputs import check_expert_inputs
from shoal.layers.moe.grouped_gemm_tile import store_tile, tile_expert, tile_pairs
from shoal.layers.moe.half_decode_experts import (
    MAX_TOKENS,
    check_shared_fits,
    decode_tiles,
    run_half_decode,
)
from shoal.layers.moe.shared_experts import SharedExperts
from shoal.layers.ops.half_gemv import HALF_DTYPES
from shoal.layers.ops.silu_mul import silu_and_mul
from shoal.layers.quantization.launch_tuner import EXACT_OPERANDS_AGREE, run_fastest


# num_pairs changes every step: not specialized (== 1, % 16) so steps do not recompile.
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr, bias_ptr,
    num_pairs, n_out, k_in, a_row_div,
    stride_am, stride_be, stride_bn, stride_cm, stride_bias,
    MUL_WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """c[pair, n] = (a[pair // a_row_div, :] . b[expert, n, :] (+ bias[expert, n]))
    (* weights[pair]) for the pairs of one block; a: [*, K], b: [E, N, K], c: [num_pairs, N],
    bias: [E, N], all contiguous along the last dim."""
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_mask = offs_k < k_in - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    store_tile(acc, c_ptr, stride_cm, pairs, valid, offs_n, n_mask, expert, bias_ptr,
               stride_bias, weights_ptr, HAS_BIAS, MUL_WEIGHTS)


def choose_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). BLOCK_M follows the mean pairs per expert: 16 (the smallest
    tl.dot tile) for decode, where each active expert sees a row or two, up to 64 for long
    prefills. fp32 (no tensor cores, a correctness path) takes half-size N and K tiles."""
    mean = -(-num_pairs // num_experts)
    block_m = min(64, max(16, triton.next_power_of_2(mean)))
    return (block_m, 32, 32) if dtype == torch.float32 else (block_m, 64, 64)


def check_quantized_inputs(x: torch.Tensor, hidden: int, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor) -> None:
    """The FP8 and INT4 expert paths' checks of what is not their weights: x [T, hidden]
    with contiguous rows in fp16/bf16/fp32, topk_ids and topk_weights [T, k]."""
    if x.dim() != 2 or x.shape[1] != hidden or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [T, {hidden}], rows contiguous")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x is {x.dtype}: need float16, bfloat16 or float32")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] \
            or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / weights "
                         f"{tuple(topk_weights.shape)} must both be [{x.shape[0]}, k]")


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, groups: ExpertGroups,
          weights: torch.Tensor | None, num_pairs: int, a_row_div: int,
          tiles: tuple[int, int, int], bias: torch.Tensor | None = None) -> None:
    block_m, block_n, block_k = tiles
    n_out, k_in = b.shape[1], b.shape[2]
    grid = (groups.block_expert.shape[0] * triton.cdiv(n_out, block_n),)
    half = a.dtype != torch.float32
    _grouped_gemm_kernel[grid](
        a, b, c, groups.sorted_ids, groups.block_expert, weights if weights is not None else c,
        bias if bias is not None else c,
        num_pairs, n_out, k_in, a_row_div,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        bias.stride(0) if bias is not None else 0,
        MUL_WEIGHTS=weights is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="tf32" if half else "ieee",
        num_warps=4, num_stages=3 if half else 2,
    )


# experts_triton's `path`: forced (tests, benchmarks)
PATHS = ("grouped", "decode")


def experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                   activation: ExpertActivation = SILU, lora: Any = None,
                   path: str | None = None, shared: SharedExperts | None = None
                   ) -> torch.Tensor:
    """Same contract as torch_experts.experts_torch: x [T, H], w13 [E, 2I, H] (gate rows then
    up rows), w2 [E, H, I], topk_weights / topk_ids [T, k], optional biases w13_bias [E, 2I]
    and w2_bias [E, H] -> [T, H] in x's dtype.

    fp16 / bf16 at T <= MAX_TOKENS without LoRA have a second path of two or three launches
    (half_decode_experts.py: no sort, the activation and the sum over the k slots fused);
    which runs is launch_tuner.run_fastest's pick per shape and T: the GPU times these
    grouped GEMMs and each decode tile once, outside CUDA-graph capture, and keeps the
    fastest that agrees with the grouped output; untimed (SHOAL_QUANT_TUNING=0, a first
    call inside a capture) the GPU runs the grouped path, the interpreter (tests) the
    decode path. path: None (that choice), "grouped", or "decode" (the first decode
    tiles, any of the three dtypes; T <= MAX_TOKENS, without LoRA: a LoRA hook always
    runs grouped).

    shared (shared_experts.py): the layer's shared experts, added to the routed sum (scaled
    per token by sigmoid(x . shared.gate) where they have a gate): the decode path runs them,
    gate included, inside its two launches (their dense weights must fit:
    SharedExperts.chunks), the grouped path adds shared.run(x) (their own launches)."""
    check_expert_inputs(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias)
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be None or one of {PATHS}, got {path!r}")
    t, k = topk_ids.shape
    if t == 0:
        return torch.zeros_like(x)
    extra = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)

    def grouped(lora: Any = None) -> torch.Tensor:
        out = _grouped(x, w13, w2, topk_weights, topk_ids, lora=lora, **extra)
        return out if shared is None else out + shared.run(x)

    if path == "grouped" or lora is not None or (path is None and (
            t > MAX_TOKENS or x.dtype not in HALF_DTYPES)):
        return grouped(lora)
    if t > MAX_TOKENS:
        raise ValueError(f"path {path!r} takes 1..{MAX_TOKENS} tokens, got {t}")
    e, two_i, h = w13.shape
    check_shared_fits(shared, x, two_i // 2)
    chunks = 0 if shared is None else shared.chunks(x, two_i // 2)
    gated = chunks > 0 and shared.gate is not None
    # (the down kernel's slots: the routed ones and the shared chunks)
    tiles = {c.name: c for c in decode_tiles(t, k + chunks, h, two_i // 2, x.device)}

    def run(name: str) -> torch.Tensor:
        if name == "grouped":
            return grouped()
        return run_half_decode(x, w13, w2, topk_weights, topk_ids, tiles[name], **extra,
                               shared=shared)

    if path == "decode":
        return run(next(iter(tiles)))
    key = ("half experts", e, two_i, h, k, t, x.dtype, w13_bias is not None,
           w2_bias is not None, activation.kind, gated, chunks,
           tuple(tiles))  # (the tiles follow the SM count: another card, another key)
    # On CUDA the grouped path comes first: the tuner checks the others against it, and
    # runs it untimed. The interpreter (tests) runs the decode path.
    names = ("grouped", *tiles) if x.is_cuda else (*tiles, "grouped")
    return run_fastest(key, names, run, x.device, EXACT_OPERANDS_AGREE)


def _grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, w13_bias: torch.Tensor | None,
             w2_bias: torch.Tensor | None, activation: ExpertActivation,
             lora: Any = None) -> torch.Tensor:
    """The grouped GEMMs (the module docstring's path)."""
    t, k = topk_ids.shape
    e, two_i, h = w13.shape
    n = t * k
    tiles = choose_tiles(n, e, x.dtype)
    groups = group_by_expert(topk_ids, e, tiles[0])
    return run_routed_experts(
        x, topk_weights, topk_ids, two_i, h,
        lambda a, c: _gemm(a, w13, c, groups, None, n, k, tiles, w13_bias),
        lambda a, c, w: _gemm(a, w2, c, groups, w, n, 1, tiles, w2_bias), activation, lora)


def run_routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       two_i: int, h: int,
                       gemm13: Callable[[torch.Tensor, torch.Tensor], None],
                       gemm2: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
                       activation: ExpertActivation, lora: Any) -> torch.Tensor:
    """The flow every grouped expert path shares (bf16 here, FP8, INT4, MXFP4 beside):
    gemm13(x, gate_up) fills each routed pair's [2I] row from its token's row of x, the LoRA
    delta and the activation follow, gemm2(act, down, topk_weights) fills each pair's [H] row
    scaled by its routing weight, and a token's k rows are summed -> [T, H] in x's dtype."""
    t, k = topk_ids.shape
    n = t * k
    gate_up = torch.empty(n, two_i, dtype=x.dtype, device=x.device)
    gemm13(x, gate_up)
    if lora is not None:
        tokens = torch.arange(n, device=x.device) // k
        experts = topk_ids.reshape(-1)
        lora.add("w13", gate_up, x.index_select(0, tokens), experts, tokens)
    act = silu_and_mul(gate_up) if activation == SILU else activation(gate_up).contiguous()
    down = torch.empty(n, h, dtype=x.dtype, device=x.device)
    gemm2(act, down, topk_weights.contiguous())
    if lora is not None:  # the GEMM scaled by the routing weight: scale the delta's input
        lora.add("w2", down, act * topk_weights.reshape(-1, 1).to(act.dtype), experts, tokens)
    return down.view(t, k, h).sum(dim=1)

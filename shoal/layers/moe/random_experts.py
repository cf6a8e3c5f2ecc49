"""Random packed experts of a FusedMoE's shapes, for load_format="dummy" (benchmarks):
valid codes and scales of a quantization scheme, made packed on the layer's device without
ever holding the dense stacks (deferred_stacks.py). Weights are of the order of 1e-3, as
loader/dummy.py's dense U(-1e-3, 1e-3), so activations stay finite through deep stacks."""

from __future__ import annotations

from typing import Any

import torch

E4M3_NAN = 0x7F  # the low 7 bits of e4m3fn's NaN bytes (0x7F, 0xFF)
TARGET = 1e-3  # the largest weight a scale allows


def _shapes(moe: Any) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(E, N, K) of w13 and w2: this rank's local experts and rows."""
    e, i, h = moe.local_num_experts, moe.inter, moe.hidden_size
    return (e, 2 * i, h), (e, h, i)


def _device(moe: Any) -> torch.device:
    return moe.w13_weight.device


def random_int4_experts(moe: Any, generator: torch.Generator, group: int,
                        sym: bool) -> Any:
    """triton_experts_int4.Int4Experts: random codes, float16 scales (as GPTQ / AWQ store
    them) in [0.5, 1] x TARGET / 8, zero points 8 (sym) or random 0..15; group -1: per
    channel."""
    from shoal.layers.moe.triton_experts_int4 import Int4Experts, int4_weights

    dev = _device(moe)
    stacks = []
    for e, n, k in _shapes(moe):
        size = k if group == -1 else min(group, k)
        groups = -(-k // size)
        codes = torch.randint(-2**31, 2**31 - 1, (e, n, -(-k // 8)), dtype=torch.int32,
                              device=dev, generator=generator)
        scale = (torch.rand(e, n, groups, device=dev, generator=generator) * 0.5 + 0.5) \
            * (TARGET / 8)
        zero = (torch.full((e, n, groups), 8, dtype=torch.uint8, device=dev) if sym else
                torch.randint(0, 16, (e, n, groups), dtype=torch.uint8, device=dev,
                              generator=generator))
        stacks.append(int4_weights(codes, scale.half().float(), zero, size, k))
    return Int4Experts(*stacks)


def random_fp8_experts(moe: Any, generator: torch.Generator,
                       block: tuple[int, int] | None) -> Any:
    """triton_experts_fp8.FP8Experts: random e4m3 bytes (NaN codes moved one step down) with
    per-row scales (block None) or one per [bn, bk] tile, TARGET / 448 x [0.5, 1]."""
    from shoal.layers.moe.triton_experts_fp8 import make_fp8_experts

    dev = _device(moe)
    made = []
    for e, n, k in _shapes(moe):
        w = torch.empty(e, n, k, dtype=torch.uint8, device=dev)
        for i in range(e):  # one expert's bytes at a time: no int64 temporary of the stack
            b = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=dev,
                              generator=generator)
            w[i] = torch.where((b & E4M3_NAN) == E4M3_NAN, b - 1, b)
        rows, group = (1, k) if block is None else block
        tiles = torch.rand(e, -(-n // rows), -(-k // group), device=dev,
                           generator=generator) * 0.5 + 0.5
        scale = (tiles * (TARGET / 448)).repeat_interleave(rows, 1)[:, :n]
        made += [w.view(torch.float8_e4m3fn), scale, group]
    return make_fp8_experts(*made)


def random_mxfp4_experts(moe: Any, generator: torch.Generator) -> Any:
    """mxfp4_experts.Mxfp4Experts: random e2m1 bytes (every byte is two valid codes) and
    e8m0 scales of 2^-13 .. 2^-11 (weights up to 6 x 2^-11 ~ 3e-3, typically ~5e-4)."""
    from shoal.layers.moe.mxfp4_experts import Mxfp4Experts, Mxfp4Weights
    from shoal.layers.quantization.mxfp4 import BLOCK, SCALE_BIAS

    dev = _device(moe)
    out = []
    for e, n, k in _shapes(moe):
        if k % BLOCK:
            raise ValueError(f"MXFP4 experts need inputs in whole blocks of {BLOCK}, got {k}")
        blocks = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=dev,
                               generator=generator)
        scales = torch.randint(SCALE_BIAS - 13, SCALE_BIAS - 10, (e, n, k // BLOCK),
                               dtype=torch.uint8, device=dev, generator=generator)
        out.append(Mxfp4Weights(blocks, scales))
    return Mxfp4Experts(*out)

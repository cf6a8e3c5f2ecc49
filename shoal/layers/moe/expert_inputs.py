"""The checks every dense (fp16 / bf16 / fp32) routed-experts path makes of its inputs: the
grouped GEMMs of triton_experts.py and the decode kernels of half_decode_experts.py."""

from __future__ import annotations

import torch

EXPERT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_expert_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None) -> None:
    """x [T, H] (rows contiguous), w13 [E, 2I, H] and w2 [E, H, I] contiguous, all of one
    dtype in EXPERT_DTYPES; topk_weights (floating) and topk_ids (int32 / int64) [T, k];
    biases [E, 2I] / [E, H] with contiguous rows. ValueError naming what does not fit."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"need x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if two_i % 2 or h != x.shape[1] or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x "
                         f"{tuple(x.shape)}")
    if not (x.dtype == w13.dtype == w2.dtype) or x.dtype not in EXPERT_DTYPES:
        raise ValueError(f"x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}: need one fp16/bf16/fp32")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] \
            or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / weights "
                         f"{tuple(topk_weights.shape)} must both be [{x.shape[0]}, k]")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError("topk_ids must be int32/int64 and topk_weights floating point")
    if x.stride(1) != 1 or not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError("x rows and the expert weights must be contiguous")
    for name, bias, shape in (("w13_bias", w13_bias, (e, two_i)), ("w2_bias", w2_bias, (e, h))):
        if bias is not None and (tuple(bias.shape) != shape or bias.stride(1) != 1):
            raise ValueError(f"expert bias {name} {tuple(bias.shape)} must be {shape}, rows "
                             "contiguous")

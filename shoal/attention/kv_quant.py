"""The FP8 KV cache (kv_cache_dtype="fp8"): keys and values stored as float8_e4m3fn, one
scale per layer for K and one for V (MLA: one for the latent row). Stored value =
saturate(x / scale) rounded to nearest even; read value = stored * scale. The scales come
from the checkpoint (shoal/loader/kv_scales.py), else 1.0.

This is the torch reference's arithmetic; the Triton kernels do the same in registers
(their KV_FP8 variants: write with the scale divided out, read as float times the scale).
Whether a layer's cache is FP8 is read off its tensor's dtype, so a drafter's own cache in
the model dtype beside an FP8 target cache needs no flag."""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448: e4m3fn has no infinity


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in float32 (correctly rounded), saturated to +-448 (a cast past it would give
    NaN), as FP8. The divisor is a tensor on x's device: CUDA torch divides by a Python
    scalar as a multiply by its reciprocal, an ulp off at some rounding ties, where the
    Triton writes (ops/fp8.py) and the CPU divide exactly."""
    divisor = torch.full((), scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a later read of x from an FP8 cache gives, in x's dtype."""
    return dequantize(quantize(x, scale), scale, x.dtype)


def copy_rows(plane: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """plane[slots] = rows for FP8 tensors: index_copy_ has no float8 kernel on the CPU, so
    the bytes are copied as uint8."""
    plane.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))


def check_scale(name: str, scale: float) -> float:
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"{name} must be a finite scale > 0 (got {scale})")
    return float(scale)

"""What the paged attention kernels share for an FP8 KV cache (attention/kv_quant.py): the
write's quantization and the wrappers' check of the cache.

Reads fold the scales into arithmetic the kernels already do: a key tile is loaded as FP8
and converted (exactly) to q's dtype, and k_scale joins the softmax scale of q . k; the
value's scale multiplies the output once, after the 1 / sum of the softmax."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shoal.attention.kv_quant import FP8_KV_DTYPE, FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_NORMAL = tl.constexpr(2.0 ** -6)  # e4m3's smallest normal; below it a step of 2^-9
_SUB_MAGIC = tl.constexpr(2.0 ** 14)  # a float32 of ulp 2^-9: (a + it) - it rounds to 2^-9
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def to_fp8(x, scale, dtype: tl.constexpr):
    """x / scale in float32, saturated to +-448, rounded to nearest even on e4m3's grid, as
    the FP8 `dtype` (torch's cast of kv_quant.quantize, bit for bit).

    The rounding is done here in float32 so that the final cast only converts exact values:
    Triton's interpreter (3.9) truncates where the rounding carries into the exponent and
    in the subnormal range; on a GPU the cast (cvt.rn.satfinite) would round the same way as
    this, at the cost of a few integer ops in a memory-bound write."""
    y = tl.clamp(x.to(tl.float32) / scale, -_FP8_MAX, _FP8_MAX)
    a = tl.abs(y)
    sub = (a + _SUB_MAGIC) - _SUB_MAGIC
    bits = a.to(tl.int32, bitcast=True)  # keep 3 of 23 mantissa bits, ties to even
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    mag = tl.where(a < _MIN_NORMAL, sub, bits.to(tl.float32, bitcast=True))
    neg = y.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 stays -0.0
    return tl.where(neg, -mag, mag).to(dtype)


@functools.cache
def _device_has_fp8(device: torch.device) -> bool:
    """Triton converts to and from e4m3 on NVIDIA GPUs of compute capability 8.9 and up
    (Ada, Hopper); the interpreter on the CPU always."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8_cache(cache: torch.Tensor, q_dtype: torch.dtype) -> bool:
    """Whether `cache` is an FP8 cache; raises ValueError where the kernels cannot read it
    (activations not fp16/bf16/fp32, a GPU without e4m3 conversions)."""
    if cache.dtype != FP8_KV_DTYPE:
        return False
    if q_dtype not in Q_DTYPES:
        raise ValueError(f"an FP8 KV cache needs fp16/bf16/fp32 activations, got {q_dtype}")
    if not _device_has_fp8(cache.device):
        raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or "
                         f"newer for the Triton kernels ({cache.device} has "
                         f"{torch.cuda.get_device_capability(cache.device)}); use "
                         "attention_backend='torch' or kv_cache_dtype='auto'")
    return True

"""What the paged attention kernels share for an FP8 KV cache (attention/kv_quant.py): the
write's quantization and the wrappers' check of the cache.

Reads fold the scales into arithmetic the kernels already do: a key tile is loaded as FP8
and converted (exactly) to q's dtype, and k_scale joins the softmax scale of q . k; the
value's scale multiplies the output once, after the 1 / sum of the softmax."""

from __future__ import annotations

import functools
import struct

import torch
import triton
import triton.language as tl

from shoal.attention.kv_quant import FP8_KV_DTYPE, FP8_MAX


def _f32_bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


# float32 bit patterns the e4m3 byte (sign | 4 exponent bits | 3 mantissa bits) is built from
_SAT_BITS = tl.constexpr(_f32_bits(FP8_MAX))  # 448, e4m3's largest finite value: byte 0x7E
_MIN_NORMAL_BITS = tl.constexpr(_f32_bits(2.0 ** -6))  # e4m3's smallest normal: byte 0x08
_SUB_MAGIC = tl.constexpr(2.0 ** 14)  # a float32 of ulp 2^-9: a + it counts 2^-9 steps in a
_SUB_MAGIC_BITS = tl.constexpr(_f32_bits(2.0 ** 14))
_REBIAS = tl.constexpr((127 - 7) << 3)  # float32's exponent bias minus e4m3's, above 3 bits
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def to_fp8(x, scale, dtype: tl.constexpr):
    """x / scale in float32, saturated to +-448, rounded to nearest even on e4m3's grid, as
    the FP8 `dtype` (torch's cast of kv_quant.quantize, bit for bit: signed zeros and NaN
    included).

    The byte is built in integer arithmetic and reinterpreted, never converted by a float
    cast: Triton's interpreter (3.9) truncates where the rounding carries into the exponent
    and in the subnormal range, and on an H100 the cast (cvt.rn.satfinite) wrote +0 (0x00)
    for negative values that round to zero, where torch writes -0 (0x80). The float steps
    left are the division, correctly rounded as torch's (div_rn: `/` compiles to an
    approximate division on a GPU), and one add whose rounding is the subnormal rounding."""
    tl.static_assert(dtype == tl.float8e4nv, "to_fp8 writes float8_e4m3fn")
    bits = tl.div_rn(x.to(tl.float32), scale).to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80  # float32's sign bit (31) as the byte's (7)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    # |x / scale| saturated at 448 (inf too), as bits: non-negative floats order as their bits
    a = tl.minimum(bits & 0x7FFFFFFF, _SAT_BITS)
    # normal: keep 3 of 23 mantissa bits, ties to even, then e4m3's exponent bias (a carry
    # out of the mantissa moves the exponent up, as it should)
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - _REBIAS
    # subnormal (a < 2^-6): a / 2^-9 to the nearest integer, ties to even, 0..8 (8 is 2^-6, byte
    # 0x08, the smallest normal): adding 2^14 rounds a to that grid in float32
    sub = (a.to(tl.float32, bitcast=True) + _SUB_MAGIC).to(tl.int32, bitcast=True) \
        - _SUB_MAGIC_BITS
    mag = tl.where(nan, 0x7F, tl.where(a < _MIN_NORMAL_BITS, sub, normal))
    return (sign | mag).to(tl.uint8).to(dtype, bitcast=True)


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

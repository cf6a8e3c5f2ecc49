"""MXFP4 weights (the OCP microscaling format) as the gpt-oss checkpoints store them: each
block of 32 values is 16 bytes of 4-bit e2m1 codes (two per byte, the even element in the low
nibble) and one byte of shared e8m0 exponent (biased by 127). A tensor `name` of [..., R, C]
is stored as `name_blocks` [..., R, C / 32, 16] and `name_scales` [..., R, C / 32].

This is the format's decoding in plain torch: the experts unpacked at load where the packed
kernel does not run (the CPU, a tensor-parallel share off the blocks), and the reference of
that kernel (shoal/layers/moe/triton_experts_mxfp4.py); e2m1 times a power of two is exact in
bf16 and fp32."""

from __future__ import annotations

import torch

BLOCK = 32  # values sharing one exponent
BYTES_PER_BLOCK = BLOCK // 2
SCALE_BIAS = 127
# The value of each e2m1 code: sign bit, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def as_uint8(t: torch.Tensor, what: str) -> torch.Tensor:
    """The loader may hand integer tensors over as float32 (exact for bytes): back to uint8."""
    if t.dtype == torch.uint8:
        return t
    if t.is_floating_point() and not torch.equal(t, t.round().clamp(0, 255)):
        raise ValueError(f"MXFP4 {what} must hold bytes (0..255)")
    return t.to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] and scales [..., G] -> [..., G * 32] values in `dtype`."""
    if blocks.dim() < 2 or blocks.shape[-1] != BYTES_PER_BLOCK \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} must be [..., G, {BYTES_PER_BLOCK}] and [..., G]")
    blocks, scales = as_uint8(blocks, "blocks"), as_uint8(scales, "scales")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1)  # [..., G, 16, 2]: low first
    values = lut[codes.long()].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponents.unsqueeze(-1))
    return out.flatten(-2).to(dtype)

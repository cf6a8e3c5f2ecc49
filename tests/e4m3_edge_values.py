"""Inputs at float8_e4m3fn's edges, for checking an FP8 write (a Triton kernel's to_fp8)
byte for byte against torch's cast (kv_quant.quantize): every finite e4m3 value, every tie
between two neighbours (nearest even; in the subnormal range too; where rounding up carries
into the exponent) and the float32 on either side of it, small negative values that round to
-0 (byte 0x80), float32 subnormals, and values past the saturation at +-448 (byte 0x7E), inf
and NaN."""

from __future__ import annotations

import torch

# x / scale = these round to -0: a tie between -0 and -2^-9 (to even: -0), just under it,
# the value an H100's cast wrote as +0, float32's smallest normal and subnormal
NEGATIVE_ZEROS = [-0.0, -2.0 ** -10, -(2.0 ** -10) * (1 - 2.0 ** -23), -0.00044, -2.0 ** -126,
                  -1e-45]
PAST_SATURATION = [448.5, 464.0, 480.0, 1e6, 3e38, float("inf"), float("nan")]


def e4m3_edge_values() -> torch.Tensor:
    """float32 [n]: the values above, both signs (but NaN's); times a scale they are the
    inputs of a write with that scale (a scale of a power of two keeps them exact)."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()  # sorted, -448 .. 448
    ties = (grid[1:] + grid[:-1]) / 2  # exact in float32
    inf = torch.tensor(float("inf"))
    positive = torch.cat([grid, ties, ties.nextafter(inf), ties.nextafter(-inf),
                          torch.tensor([2.0 ** -126, 1e-45, 1e-30])]).abs()
    beyond = torch.tensor(PAST_SATURATION)
    return torch.cat([positive, -positive, torch.tensor(NEGATIVE_ZEROS), beyond,
                      -beyond[:-1]])

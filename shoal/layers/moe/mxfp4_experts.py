"""MXFP4 experts kept packed (gpt-oss as released): the run-time form a FusedMoE holds, and
whether a layer can hold it. Imports no Triton: the model's loader asks before the kernel
(triton_experts_mxfp4.py) is ever imported.

Each projection of every local expert stays in the checkpoint's own layout
(shoal/layers/quantization/mxfp4.py), rows first:
- blocks uint8 [E, N, K / 2]: codes k and k + 1 of output n in the low and high nibble of
  byte [n, k // 2] (k even);
- scales uint8 [E, N, K / 32]: w[e, n, k] = e2m1(code) * 2^(scales[e, n, k // 32] - 127).
The rows are FusedMoE's (w13: this rank's gate rows, then its up rows; w2: H rows of this
rank's inputs), so a tensor-parallel rank's share of the down projection's inputs must be
whole 32-value blocks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from shoal import envs
from shoal.layers.quantization.mxfp4 import BLOCK, BYTES_PER_BLOCK, as_uint8, dequantize_mxfp4

NAN_SCALE = 255  # e8m0's NaN: no finite weight has it
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class Mxfp4Weights:
    """One projection of every local expert (the module docstring's layout)."""

    blocks: torch.Tensor  # uint8 [E, N, K / 2]
    scales: torch.Tensor  # uint8 [E, N, K / 32]

    @property
    def out_features(self) -> int:
        return self.blocks.shape[1]

    @property
    def in_features(self) -> int:
        return self.blocks.shape[2] * 2


@dataclass
class Mxfp4Experts:
    """A FusedMoE's experts in MXFP4: w13 ([E, 2I] outputs: gate rows, then up rows, of H
    inputs) and w2 (H outputs of I inputs)."""

    w13: Mxfp4Weights
    w2: Mxfp4Weights

    name = "mxfp4 experts (Triton, e2m1 decoded in registers)"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers().values())

    def buffers(self) -> dict[str, torch.Tensor]:
        """The tensors FusedMoE registers, by buffer name."""
        return {"w13_blocks": self.w13.blocks, "w13_scales": self.w13.scales,
                "w2_blocks": self.w2.blocks, "w2_scales": self.w2.scales}


def mxfp4_weights(blocks: torch.Tensor, scales: torch.Tensor) -> Mxfp4Weights:
    """From one projection's stacks as the checkpoint stores them: blocks [E, N, G, 16] and
    scales [E, N, G] (uint8, or float32 holding bytes as the loader streams them). ValueError
    (a short reason) where the kernel cannot take them."""
    if blocks.dim() != 4 or blocks.shape[-1] != BYTES_PER_BLOCK \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 expert blocks {tuple(blocks.shape)} / scales "
                         f"{tuple(scales.shape)}: need [E, N, G, {BYTES_PER_BLOCK}] and "
                         "[E, N, G]")
    blocks, scales = as_uint8(blocks, "blocks"), as_uint8(scales, "scales")
    if scales.numel() and int(scales.max()) == NAN_SCALE:
        raise ValueError(f"MXFP4 expert scales hold {NAN_SCALE} (NaN in e8m0)")
    e, n, g, _ = blocks.shape
    return Mxfp4Weights(blocks.reshape(e, n, g * BYTES_PER_BLOCK).contiguous(),
                        scales.contiguous())


def packed_experts_problem(moe: Any, allow_cpu: bool = False) -> str | None:
    """Why the FusedMoE `moe` (its dense stacks allocated or deferred, not yet loaded) cannot
    hold MXFP4 experts packed; None: it can. allow_cpu: tests, with the kernel under
    TRITON_INTERPRET=1."""
    from shoal.layers.ops.dispatch import TRITON_AVAILABLE

    w = moe.w13_weight
    if envs.SHOAL_QUANT_DEQUANT.get():
        return f"{envs.SHOAL_QUANT_DEQUANT.name}=1 dequantizes them at load"
    if w.device.type != "cuda" and not (allow_cpu and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"the kernel runs on CUDA, the experts are on the {w.device.type}"
    if not TRITON_AVAILABLE:
        return "Triton is not installed"
    if not moe.use_triton_ops:
        return "use_triton_ops is off"
    if w.device.type == "cuda" and torch.cuda.get_device_capability(w.device) < (8, 0):
        return "the MXFP4 kernel needs compute capability 8.0"
    if w.dtype not in ACTIVATION_DTYPES:
        return f"the kernel takes float16, bfloat16 or float32 activations, not {w.dtype}"
    if moe.inter % BLOCK:
        return (f"a rank's share of the expert inputs ({moe.inter} of "
                f"{moe.inter * moe.tp_size}) is not whole blocks of {BLOCK}")
    return None


def dequantize_mxfp4_experts(w: Mxfp4Weights, dtype: torch.dtype = torch.float32
                             ) -> torch.Tensor:
    """[E, N, K] in `dtype` from one projection's packed stack (mxfp4.py's decoding)."""
    e, n, half_k = w.blocks.shape
    g = half_k // BYTES_PER_BLOCK
    return dequantize_mxfp4(w.blocks.view(e, n, g, BYTES_PER_BLOCK), w.scales, dtype)

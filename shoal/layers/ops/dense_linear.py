"""y = x W^T (+ b) for the dense (unquantized) linear layers of shoal/layers/linear.py: the one
place their matmul is chosen.

- On by default (SHOAL_DENSE_GEMV=0 turns it off; its tiles compile and are timed at
  start-up), a few rows (1..half_gemv.MAX_ROWS: a decode step) of bf16/fp16 CUDA tensors,
  with Triton and the layer's use_triton_ops: launch_tuner.run_fastest between F.linear and
  the Triton GEMVs of half_gemv.py. F.linear is the first candidate: what a shape not timed
  yet takes (during a CUDA-graph capture, with SHOAL_QUANT_TUNING=0) and the reference every
  GEMV must agree with before it may win on time. One tuning key per weight shape, bias or
  not, row bucket (a power of two) and dtype. Measured on an H100: at 1 row the best tile
  took 0.79-0.97 of F.linear's time on GPT-OSS-20B's and Llama-3.1-8B's qkv, o and gate_up,
  at 8 rows 1.1-1.6x it (2026-12-06, tests/layers/test_half_gemv.py); end to end with PDL,
  whose chain the GEMVs keep where cuBLAS's kernels break it (2026-12-07): W2 batch 1 on
  the 8B shape 171.7 -> 179.5 tok/s, Qwen3.5-35B-A3B batch 1 307.4 -> 316.3; the start-up
  grew by ~7 s with a cold Triton cache.
- Anything else: small_linear.linear (the C++ kernel for a few CPU rows, else F.linear), as
  before."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal import envs
from shoal.layers.ops import small_linear
from shoal.layers.ops.dispatch import use_triton
from shoal.layers.quantization.launch_tuner import EXACT_OPERANDS_AGREE, run_fastest

REFERENCE = "F.linear"  # the first candidate's name
MAX_ROWS = 8  # = half_gemv.MAX_ROWS (not imported here: that module needs Triton)
HALF_DTYPES = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           use_triton_ops: bool = True) -> torch.Tensor:
    if _on_gpu(x, use_triton_ops) and _gemv_takes(x, weight, bias) and envs.SHOAL_DENSE_GEMV.get():
        return _tuned(x, weight, bias)
    return small_linear.linear(x, weight, bias)


def _on_gpu(x: torch.Tensor, enabled: bool) -> bool:
    """(A seam: the tests route CPU tensors through the tuner in Triton's interpreter.)"""
    return use_triton(x, enabled)


def _gemv_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    k = weight.shape[-1]
    return (x.dtype in HALF_DTYPES and weight.dtype == x.dtype and weight.dim() == 2
            and x.dim() >= 1 and x.shape[-1] == k and 0 < x.numel() // max(k, 1) <= MAX_ROWS
            and x.stride(-1) == 1 and weight.stride(1) == 1
            and (bias is None or (bias.dtype == x.dtype and bias.dim() == 1
                                  and bias.stride(0) == 1)))


@dataclass(frozen=True)
class _Candidates:
    """A shape's launch candidates: F.linear's name first, then the GEMV tiles by name. Built
    once per shape: the eager decode path asks at every call of every layer."""
    names: tuple[str, ...]
    tiles: dict


@functools.cache
def _candidates(n: int, k: int, rows: int, device: torch.device) -> _Candidates:
    from shoal.layers.ops import half_gemv

    tiles = {t.name: t for t in half_gemv.candidates(n, k, rows, device)}
    return _Candidates((REFERENCE, *tiles), tiles)


def tune_key(n: int, k: int, has_bias: bool, rows: int, dtype: torch.dtype) -> tuple:
    """The launch tuner's key: rows rounded up to a power of two (one choice per bucket)."""
    return ("dense half gemv", n, k, has_bias, 1 << (rows - 1).bit_length(), dtype)


def _tuned(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from shoal.layers.ops.half_gemv import half_gemv

    n, k = weight.shape
    flat = x.reshape(-1, k)
    key = tune_key(n, k, bias is not None, flat.shape[0], flat.dtype)
    cands = _candidates(n, k, key[4], flat.device)

    def run(name: str) -> torch.Tensor:
        if name == REFERENCE:
            return F.linear(flat, weight, bias)
        return half_gemv(flat, weight, bias, cands.tiles[name])

    return run_fastest(key, cands.names, run, flat.device,
                       EXACT_OPERANDS_AGREE).view(*x.shape[:-1], n)

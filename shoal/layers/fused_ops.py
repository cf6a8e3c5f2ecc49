"""Whether a tensor takes the fused Triton kernels (shoal/attention/ops) instead of PyTorch.

Only CUDA tensors do, and only when Triton is installed; SHOAL_DISABLE_TRITON_OPS=1 forces
the PyTorch path (for A/B checks on the GPU)."""

from __future__ import annotations

import importlib.util
import os

import torch

_AVAILABLE = importlib.util.find_spec("triton") is not None and os.environ.get(
    "SHOAL_DISABLE_TRITON_OPS") != "1"


def use_triton(x: torch.Tensor) -> bool:
    return _AVAILABLE and x.is_cuda

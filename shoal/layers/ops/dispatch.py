"""Whether a layer runs a tensor through its Triton kernel (shoal/layers/ops) or PyTorch.

Only CUDA tensors do, only when Triton is installed, and only in layers built with
use_triton_ops=True (the engine argument of that name; off gives the PyTorch path, for A/B
checks on the GPU). The layer holds its own flag: no process-wide switch."""

from __future__ import annotations

import importlib.util

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor, enabled: bool) -> bool:
    return enabled and TRITON_AVAILABLE and x.is_cuda

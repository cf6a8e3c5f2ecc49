"""Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; with one they
run compiled, on CUDA tensors. triton.jit reads TRITON_INTERPRET when a kernel is defined,
that is when its module is imported, and pytest imports this file before the test modules
beside it: so any one of them, run alone or in the suite, gets the interpreter."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

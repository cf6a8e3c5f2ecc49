"""Batched multi-adapter LoRA for one linear layer: every token of a batch adds the delta of
its own adapter (or none) to the base layer's output, in place.

Slot buffers, per layer: a [S, n_sub*R, in] holds the A matrices of up to n_sub fused
sub-projections (sub i in rows i*R:(i+1)*R, a rank below R zero-padded); b [S, out, R] holds
the B matrices, already scaled, output rows sub_offsets[i]:sub_offsets[i+1] (the last up to
out) belonging to sub i and reading its R columns of h = a[s] @ x[t]. token_slots[t] is the
slot of token t, -1 for none.

CUDA tensors take the Triton kernels (lora_triton.py, CUDA-graph safe) when use_triton is set
and Triton is installed; anything else takes the PyTorch path (lora_torch.py)."""

from __future__ import annotations

import functools
from types import ModuleType

from torch import Tensor

from shoal.layers.ops.dispatch import use_triton as _triton_for
from shoal.lora.ops import lora_torch


@functools.cache
def _triton() -> ModuleType:
    from shoal.lora.ops import lora_triton  # imports triton: only where it runs

    return lora_triton


def add_lora(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor,
             sub_offsets: tuple[int, ...], rank: int, *, use_triton: bool) -> None:
    """y [T, out] += each token's LoRA delta for x [T, in]; see the module docstring."""
    if _triton_for(x, use_triton):
        _triton().add_lora(y, x, a, b, token_slots, sub_offsets, rank)
    else:
        lora_torch.add_lora(y, x, a, b, token_slots, sub_offsets, rank)

"""Sub-byte integers packed into int32 words, as GPTQ and AWQ store them."""

from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The `32 // bits` values of each int32 of `packed`, lowest bits first, laid out along
    `dim` (which grows by that factor); unsigned, as int32."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32 (got {packed.dtype})")
    per_word = 32 // bits
    dim = dim % packed.dim()
    shape = [1] * (packed.dim() + 1)
    shape[dim + 1] = per_word
    shifts = (torch.arange(per_word, dtype=torch.int32) * bits).view(shape)
    # The shift is arithmetic (int32 is signed): the mask drops the sign bits it drags in.
    values = (packed.unsqueeze(dim + 1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(dim, dim + 1)

"""AWQ weights (AutoAWQ and llm-awq, "gemm" version), dequantized at load.

A quantized linear `P` with K inputs, N outputs and groups of group_size inputs stores
- `P.qweight` int32 [K, N / 8]: 4-bit codes packed along the output dim, 8 per word. The
  GEMM kernel reads them interleaved: nibble i (bits 4i .. 4i+3) of word [k, j] is output
  8j + ORDER[i], ORDER = [0, 2, 4, 6, 1, 3, 5, 7];
- `P.qzeros` int32 [K / group_size, N / 8]: zero points, packed and interleaved alike;
- `P.scales` float16 [K / group_size, N];
- `P.bias` when the original layer had one: an ordinary tensor, passed through (some
  exporters write one of zeros for every layer: those are dropped, formats.py).

weight[n, k] = scales[k // group_size, n] * (code[k, n] - zero[k // group_size, n]).
Unlike GPTQ's, the stored zero is the zero (no offset), and there is no act-order.
"""

from __future__ import annotations

import torch

from shoal.quantization.packing import unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds output ORDER[i] of its 8
# The nibble holding output c: indexing the unpacked nibbles with it restores output order.
_NIBBLE_OF_OUTPUT = tuple(AWQ_ORDER.index(c) for c in range(8))


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, N / 8] int32 -> [R, N] int32 codes in output order."""
    nibbles = unpack_int32(packed, 4, dim=1)
    rows, n = nibbles.shape
    return nibbles.view(rows, n // 8, 8)[:, :, list(_NIBBLE_OF_OUTPUT)].reshape(rows, n)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """float32 [N, K] (outputs first)."""
    codes = unpack_awq(qweight)  # [K, N]
    zeros = unpack_awq(qzeros)  # [G, N]
    k, n = codes.shape
    size = k if group_size == -1 else group_size
    groups = -(-k // size)
    if zeros.shape != (groups, n) or scales.shape != (groups, n):
        raise ValueError(f"AWQ shapes disagree: qweight unpacks to [{k}, {n}] ({groups} "
                         f"groups of {size}), qzeros to {list(zeros.shape)}, scales are "
                         f"{list(scales.shape)}")
    g = torch.arange(k) // size
    weight = (codes - zeros[g]).to(torch.float32) * scales.to(torch.float32)[g]
    return weight.t().contiguous()

"""GPTQ weights (AutoGPTQ, GPTQModel, optimum), dequantized at load.

A quantized linear `P` with K inputs, N outputs, b bits (b = 4 or 8: p = 32 / b values per
int32 word) and G groups of inputs stores
- `P.qweight` int32 [K / p, N]: the b-bit codes, packed along the input dim: input k of
  output n is bits (k % p) * b .. + b of word [k // p, n], lowest bits first;
- `P.qzeros` int32 [G, N / p]: each group's zero point per output, packed the same way
  but along the output dim;
- `P.scales` float16 [G, N];
- `P.g_idx` int32 [K]: the group of each input. With act-order (desc_act) the inputs were
  quantized in order of activation size, so groups are scattered; without it g_idx is
  k // group_size (written anyway by most tools, and then not read here);
- `P.bias` when the original layer had one: an ordinary tensor, passed through (some
  exporters write one of zeros for every layer: those are dropped, formats.py).
G is K / group_size, or 1 for group_size -1 (one group over all inputs).

weight[n, k] = scales[g, n] * (code[k, n] - zero[g, n]) with g = g_idx[k].

Zero points: checkpoint_format "gptq" (v1, the default) stores zero - 1 (AutoGPTQ's packer
subtracted one, and every reader adds it back, unmasked, so a zero of 0 cannot be stored);
"gptq_v2" stores the zero itself. Symmetric checkpoints use zero 2^(b-1) throughout.
"""

from __future__ import annotations

import torch

from shoal.quantization.packing import unpack_int32


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None, bits: int, group_size: int,
                    v1_zeros: bool = True) -> torch.Tensor:
    """float32 [N, K] (shoal's and torch's layout: outputs first)."""
    codes = unpack_int32(qweight, bits, dim=0)  # [K, N]
    zeros = unpack_int32(qzeros, bits, dim=1)  # [G, N]
    if v1_zeros:
        zeros = zeros + 1
    k, n = codes.shape
    if scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"GPTQ shapes disagree: qweight unpacks to [{k}, {n}], qzeros to "
                         f"{list(zeros.shape)}, scales are {list(scales.shape)}")
    if g_idx is None:
        g_idx = sequential_groups(k, group_size)
    if g_idx.shape != (k,):
        raise ValueError(f"GPTQ g_idx has shape {list(g_idx.shape)}; qweight has {k} inputs")
    g = g_idx.long()
    if int(g.max()) >= scales.shape[0] or int(g.min()) < 0:
        raise ValueError(f"GPTQ g_idx names groups 0..{int(g.max())}; scales have "
                         f"{scales.shape[0]}")
    weight = (codes - zeros[g]).to(torch.float32) * scales.to(torch.float32)[g]
    return weight.t().contiguous()


def sequential_groups(k: int, group_size: int) -> torch.Tensor:
    """g_idx without act-order: consecutive runs of group_size inputs (-1: one group)."""
    size = k if group_size == -1 else group_size
    return torch.arange(k, dtype=torch.int32) // size

"""4-bit weights on the CPU: the linear layers of a Q4_0 / Q4_1 GGUF run with torch's int4
weight-only kernel (`_weight_int4pack_mm_for_cpu`) instead of dense dequantized matmuls.

GGUF's 4-bit formats store each row in groups of 32 weights as w = q * d + m (q in 0..15; Q4_0
is the same with m = -8 d). llama.cpp picks m as the group's minimum and d as its range / 15,
so the dequantized group holds both m (q = 0) and m + 15 d (q = 15): d, m and q are recovered
from the loaded dense weight itself, whatever fused layout (qkv, gate_up) and row permutation
the loader gave it. A group that does not decode back to within a rounding error of its
values (a weight that was never 4-bit, a Q8_0 or float tensor) leaves the whole layer dense.

torch's kernel computes w = (q - 8) * scale + zero per group with scale and zero in the
activations' dtype; it is fast with bfloat16 activations only (float32 ones take a scalar
path, 3x slower than a dense float32 matmul on this machine), so the layer's input is cast to
bfloat16 for the product and the result back to the model's dtype. That rounds the inputs
and the scales: outputs are close to, not identical with, the dequantized model's.

Where it pays: a step of a few tokens streams every weight once for little arithmetic, so
reading 4 bits a weight instead of 16 wins (SmolLM2 batch-1 decode 1.6x); with more rows
the kernel's unpacking costs more than the dense matmul (measured on this project's 2-core
AMD EPYC, one thread: even at 8 rows, 1.4x slower at 16, 2x at 64). By default
(cpu_int4_matmul unset) a layer keeps its dense weight beside the packed one and takes the
packed one for steps of at most SMALL_STEP_ROWS tokens only; cpu_int4_matmul=True frees
the dense weights and runs every step packed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

GROUP = 32
SMALL_STEP_ROWS = 8  # rows (tokens) up to which the packed weights are faster than dense
# |dequantized - recovered| allowed per weight: float32 rounding of q * d + m (a thousandth
# of the step d) plus the rounding of the weight's own dtype (bfloat16 keeps 8 bits), both
# far below half a step, which is what a weight that was never 4-bit misses by.
_STEP_TOLERANCE = 1e-3


@dataclass
class Int4Weight:
    packed: torch.Tensor  # [N, K / 2] uint8, the kernel's layout
    scales_zeros: torch.Tensor  # [K / GROUP, N, 2] bfloat16
    out_features: int
    in_features: int
    max_rows: int | None = None  # None: every step; else steps of at most this many tokens

    def takes(self, x: torch.Tensor) -> bool:
        return self.max_rows is None or x.numel() <= self.max_rows * self.in_features

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.scales_zeros.numel() * self.scales_zeros.element_size())


def recover_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                   torch.Tensor] | None:
    """(q [N, K] int32 in 0..15, d [N, K/G], m [N, K/G]) with weight == q * d + m up to
    rounding, or None when the weight is not 4-bit groups of GROUP."""
    n, k = weight.shape
    if k % GROUP or n % 16:
        return None
    eps = torch.finfo(weight.dtype).eps if weight.dtype.is_floating_point else 0.0
    w = weight.detach().float().view(n, k // GROUP, GROUP)
    m = w.amin(-1)
    d = (w.amax(-1) - m) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((w - m[..., None]) / safe[..., None])
    if q.min() < 0 or q.max() > 15:
        return None
    err = (q * d[..., None] + m[..., None] - w).abs()
    # d and m are recovered from rounded values too: allow two units in the last place of the
    # group's largest weight on top of the float32 rounding.
    allowed = _STEP_TOLERANCE * safe + 2 * eps * w.abs().amax(-1) + 1e-12
    if (err > allowed[..., None]).any():
        return None
    return q.to(torch.int32).view(n, k), d, m


def pack_int4(weight: torch.Tensor) -> Int4Weight | None:
    groups = recover_groups(weight)
    if groups is None:
        return None
    q, d, m = groups
    n, k = weight.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # (q - 8) * d + zero == q * d + m  <=>  zero = m + 8 d
    sz = torch.stack([d.t(), (m + 8 * d).t()], dim=-1).contiguous().to(torch.bfloat16)
    return Int4Weight(packed, sz, n, k)


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    flat = x.reshape(-1, w.in_features).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, w.packed, GROUP, w.scales_zeros)
    return y.to(x.dtype).view(*x.shape[:-1], w.out_features)


def supported() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def convert_linears(model: nn.Module, small_steps_only: bool = False) -> dict[str, int]:
    """Gives every linear layer whose weight is 4-bit groups an `int4` weight and frees its
    dense one, or with small_steps_only keeps the dense one for steps of more than
    SMALL_STEP_ROWS tokens. Returns counts: converted layers, dense layers left, bytes of
    the converted layers' dense and packed weights."""
    if not supported():
        raise ValueError("cpu_int4_matmul needs torch's _weight_int4pack_mm_for_cpu "
                         f"(torch {torch.__version__} lacks it)")
    stats = {"converted": 0, "dense": 0, "dense_bytes": 0, "int4_bytes": 0}
    for _, mod in model.named_modules():
        if not hasattr(mod, "int4"):  # the linear layers of shoal/layers/linear.py
            continue
        if getattr(mod, "weight_only", False):  # read as a tensor, never run as a layer
            stats["dense"] += 1
            continue
        w = mod.weight
        packed = pack_int4(w)
        if packed is None:
            stats["dense"] += 1
            continue
        stats["converted"] += 1
        stats["dense_bytes"] += w.numel() * w.element_size()
        stats["int4_bytes"] += packed.nbytes
        mod.int4 = packed
        if small_steps_only:
            packed.max_rows = SMALL_STEP_ROWS
        else:
            mod.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
    return stats

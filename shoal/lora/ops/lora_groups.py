"""The CPU's LoRA step: tokens grouped by adapter once per step (LoRAStep.set), not once per
layer, and each fused layer's B kept block-diagonal ([out, n_sub * R]: sub i's rows read only
its R columns), so an adapter costs one shrink and one expand matmul per layer whatever the
number of fused sub-projections (lora_torch.add_lora, the reference, groups the tokens again
in every layer call)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SlotGroup:
    slot: int
    rows: slice | Tensor  # the adapter's tokens: one run as a slice, else their indices


def group_tokens(slots: list[int]) -> list[SlotGroup]:
    """The step's tokens by adapter slot (slot -1, the base model, left out)."""
    runs: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            if slots[start] >= 0:
                runs.setdefault(slots[start], []).append((start, i))
            start = i
    groups = []
    for slot, spans in runs.items():
        if len(spans) == 1:
            groups.append(SlotGroup(slot, slice(*spans[0])))
        else:
            idx = torch.cat([torch.arange(lo, hi) for lo, hi in spans])
            groups.append(SlotGroup(slot, idx))
    return groups


def block_diagonal(b: Tensor, sub_offsets: tuple[int, ...], rank: int) -> Tensor:
    """b [out, R] of one slot -> [out, n_sub * R], sub i's rows in its own R columns."""
    out = b.shape[0]
    full = b.new_zeros(out, len(sub_offsets) * rank)
    bounds = zip(sub_offsets, (*sub_offsets[1:], out))
    for i, (lo, hi) in enumerate(bounds):
        full[lo:hi, i * rank:(i + 1) * rank] = b[lo:hi]
    return full


def add_lora_groups(y: Tensor, x: Tensor, a: Tensor, b_full: Tensor,
                    groups: list[SlotGroup]) -> None:
    """y [T, out] += B A x for each group's tokens; a [S, n_sub*R, in], b_full [S, out,
    n_sub*R] (block-diagonal)."""
    for g in groups:
        if isinstance(g.rows, slice):
            h = x[g.rows] @ a[g.slot].T
            y[g.rows].addmm_(h, b_full[g.slot].T)
        else:
            h = x.index_select(0, g.rows) @ a[g.slot].T
            y.index_add_(0, g.rows, h @ b_full[g.slot].T)

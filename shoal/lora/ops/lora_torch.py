"""The PyTorch path of the batched multi-adapter LoRA op (the CPU path and the reference of the
Triton kernels in lora_triton.py).

y[t] += B[s] (A[s] x[t]) for every token t whose adapter slot s = token_slots[t] is >= 0, with
the slot buffers laid out as shoal.lora.ops.add_lora documents. Tokens are grouped by slot so
that each adapter present costs one shrink matmul and one expand matmul per sub-projection,
whatever the number of its tokens (a prefill of one request is a single group: no gather).

Rounding: the shrink result h = A x is rounded to x's dtype before the expand (torch's matmul
accumulates in float32 and returns x's dtype; the Triton path rounds its workspace the same
way), as vLLM does for bfloat16; in float32 the op is exact up to summation order. The expand
product is rounded to y's dtype before its add here, where the Triton kernel adds in float32
and rounds once: the two paths differ by one rounding of y in 16-bit dtypes.

Grouping reads token_slots on the host (one sync): not for CUDA graphs, which take the Triton
path."""

from __future__ import annotations

import torch
from torch import Tensor


def check_args(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor,
               sub_offsets: tuple[int, ...], rank: int) -> list[tuple[int, int]]:
    """Raises ValueError on inconsistent shapes, dtypes or offsets; returns each sub-projection's
    [start, end) output rows."""
    if x.dim() != 2 or y.dim() != 2 or a.dim() != 3 or b.dim() != 3 or token_slots.dim() != 1:
        raise ValueError(f"expected x [T, in], y [T, out], a [S, n_sub*R, in], b [S, out, R] and "
                         f"token_slots [T]; got x {tuple(x.shape)}, y {tuple(y.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)}, "
                         f"token_slots {tuple(token_slots.shape)}")
    n_tokens, out = y.shape
    n_sub = len(sub_offsets)
    if x.shape[0] != n_tokens or token_slots.shape[0] != n_tokens:
        raise ValueError(f"token counts differ: x {tuple(x.shape)}, y {tuple(y.shape)}, "
                         f"token_slots {tuple(token_slots.shape)}")
    if rank < 1 or n_sub < 1:
        raise ValueError(f"rank {rank} and the number of sub-projections {n_sub} must be >= 1")
    if a.shape != (a.shape[0], n_sub * rank, x.shape[1]):
        raise ValueError(f"a {tuple(a.shape)} must be [S, n_sub*R = {n_sub * rank}, "
                         f"in = {x.shape[1]}]")
    if b.shape != (a.shape[0], out, rank):
        raise ValueError(f"b {tuple(b.shape)} must be [S = {a.shape[0]}, out = {out}, "
                         f"R = {rank}]")
    if sub_offsets[0] != 0 or any(lo >= hi for lo, hi in zip(sub_offsets, sub_offsets[1:])) \
            or sub_offsets[-1] >= out:
        raise ValueError(f"sub_offsets {sub_offsets} must start at 0 and increase strictly "
                         f"below out = {out}")
    if not (x.dtype == y.dtype == a.dtype == b.dtype):
        raise ValueError(f"dtypes differ: x {x.dtype}, y {y.dtype}, a {a.dtype}, b {b.dtype}")
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be int32 or int64, got {token_slots.dtype}")
    return list(zip(sub_offsets, (*sub_offsets[1:], out)))


def add_lora(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor,
             sub_offsets: tuple[int, ...], rank: int) -> None:
    """In place: y[t] += the LoRA delta of token t's adapter (nothing for slot -1)."""
    bounds = check_args(y, x, a, b, token_slots, sub_offsets, rank)
    n_tokens = x.shape[0]
    if n_tokens == 0:
        return
    first = int(token_slots[0])
    # One slot for the whole batch (a decode of one, a prefill of one request): no gather.
    if n_tokens == 1 or bool((token_slots == first).all()):
        if first >= 0:
            _check_slot(first, a.shape[0])
            h = x @ a[first].T
            for i, (lo, hi) in enumerate(bounds):
                y[:, lo:hi].addmm_(h[:, i * rank:(i + 1) * rank], b[first, lo:hi].T)
        return
    order = torch.argsort(token_slots, stable=True)
    slots, counts = torch.unique_consecutive(token_slots[order], return_counts=True)
    for slot, idx in zip(slots.tolist(), order.split(counts.tolist())):
        if slot < 0:
            continue
        _check_slot(slot, a.shape[0])
        h = x.index_select(0, idx) @ a[slot].T
        if len(bounds) == 1:
            delta = h @ b[slot].T
        else:
            delta = torch.cat([h[:, i * rank:(i + 1) * rank] @ b[slot, lo:hi].T
                               for i, (lo, hi) in enumerate(bounds)], dim=1)
        y.index_add_(0, idx, delta)


def _check_slot(slot: int, n_slots: int) -> None:
    if slot >= n_slots:
        raise ValueError(f"adapter slot {slot} out of range: the buffers hold {n_slots}")

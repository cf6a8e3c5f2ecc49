"""Group the (token, slot) pairs of a step by expert for the grouped-GEMM kernel, with torch
ops that never read data back to the host: every output shape follows from the number of
pairs, the number of experts and the block size alone, so a decode step can be captured in a
CUDA graph and replayed with any routing."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of block_m rows needed in the worst case: each expert that gets any pair wastes
    fewer than block_m rows of padding, and at most min(pairs, experts) experts get one."""
    used = min(num_pairs, num_experts)
    return -(-(num_pairs + used * (block_m - 1)) // block_m)


@dataclass(frozen=True)
class ExpertGroups:
    """sorted_ids: int32 [blocks * block_m], pair indices (token * k + slot) grouped by expert,
    each expert's group padded to whole blocks with num_pairs (read as "no row");
    block_expert: int32 [blocks], the expert of each block, -1 for the unused tail blocks."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGroups:
    """topk_ids: [T, k], values in [0, num_experts)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    blocks = max_blocks(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # not bincount: it syncs on CUDA
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    # A pair's row: its expert's padded start plus its rank among that expert's pairs (the
    # stable sort keeps token order within an expert).
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[expert]
    rows = (padded_end - padded)[expert] + rank
    sorted_ids = torch.full((blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, rows, order.to(torch.int32))
    # Block b belongs to the first expert whose padded group ends after row b * block_m;
    # empty experts end where the previous one does and are skipped.
    starts = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertGroups(sorted_ids, block_expert, block_m)

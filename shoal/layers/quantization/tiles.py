"""Tile sizes of the quantized GEMMs, chosen by shape (no autotuning: a tuning run inside a
CUDA-graph capture would break it). Small M (decode) is memory-bound: one 16-row tile of
tokens and the K loop split over several programs so that the weight read spreads over every
SM; large M (prefill) takes big tiles and no split. benchmarks/quant_gpu.py times them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

SMALL_M = 64  # rows up to which the decode tiles are used


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose(m: int, n: int, k: int, block_k: int, device: torch.device) -> Tiles:
    """block_k is fixed by the format (a group of scales per K step)."""
    if m <= SMALL_M:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n = 64 if device.type == "cuda" else 32
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        steps = triton.cdiv(k, block_k)
        # enough programs for two waves over the SMs, each keeping >= 2 K steps
        split = 1
        while tiles * split * 2 <= 2 * sm_count(device) and steps // (split * 2) >= 2:
            split *= 2
        return Tiles(block_m, block_n, block_k, split, 4, 3)
    block_n = 128 if device.type == "cuda" else 32
    block_m = 128 if m >= 256 and device.type == "cuda" else 64
    return Tiles(block_m, block_n, block_k, 1, 8 if block_m == 128 else 4, 3)


def k_per_split(k: int, block_k: int, split: int) -> int:
    """Inputs each split of the K loop covers: whole K steps."""
    return triton.cdiv(triton.cdiv(k, block_k), split) * block_k

"""Triton kernels of the batched multi-adapter LoRA op (the role of punica's BGMV and SGMV),
for CUDA graphs: no host sync, launch grids and workspaces sized from the shapes only, never
from the slots' values; one workspace allocation per call.

Two paths, each a shrink (h = A[s] x, float32 partials over shares of the input features)
and an expand (y += B[s] round(h), added in float32, rounded once into y):

- split-K (lora_split_k.py), for decode steps below SEGMENTED_MIN_TOKENS tokens: one program
  per token, the input features split over programs so that a single token still spreads
  its adapter's A over ~128 programs. At rank 16 a token's A and B are well under 1 MB, so
  at T = 1 each kernel is latency-bound: about a launch plus two dependent load round trips
  (the slot, then A or B), a few microseconds in a CUDA graph. Each token re-reads its
  adapter's A and B (from L2 after the first), so the traffic grows with T.
- segmented (lora_segmented.py), from SEGMENTED_MIN_TOKENS tokens: the tokens grouped by
  slot on the device into segments of 16-64 tokens of one adapter, A and B read once per
  segment, tl.dot on the tensor cores; for prefills and for decode batches spread over many
  adapters. Its grid is bounded by T // BLOCK_T + min(S, T) segments. What it costs beyond
  the unavoidable bytes (x read once by the shrink, y read and written once by the expand:
  at T = 2,048 on the 8B shape ~10-14 % of the base projection's matmul) is its planning,
  two passes over token_slots in every shrink program: a microsecond or two at T <= 1,024,
  about what the split-K pair spends at a few tokens, hence the threshold.

Tokens whose slot is -1 are left alone by both paths. A slot >= S is not checked (that
would need a sync): the caller's slot table guarantees it (the split-K path would read out
of bounds, the segmented one skips it). With more than lora_segmented.MAX_SLOTS slots (MoE
expert LoRA flattens slots x experts) the split-K path runs at every size. A token's result
does not depend on the other tokens of its step, only on the path and split count, which
the step's size picks. Ranks above 64 (for q|k|v; lora_segmented.supports) take split-K at
every size."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from shoal import envs
from shoal.lora.ops import lora_segmented
from shoal.lora.ops.lora_split_k import add_lora_split_k
from shoal.lora.ops.lora_torch import check_args

MAX_SUBS = 4  # the expand kernels compare a row with three sub-projection starts
# Steps of at least this many tokens take the segmented path: a module attribute, which
# benchmarks/lora_gpu.py --segmented-min-tokens sets (in process) to sweep it.
# H100, 2026-12-05 (benchmarks/results/2026-12-05-lora-3f3ee93-H100.json): at 32 tokens
# split-K was faster in 7 of 8 projection x adapter-count rows, at 64 segmented in all 8.
SEGMENTED_MIN_TOKENS = 64
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KernelPath = Literal["split_k", "segmented"]


def choose_path(n_tokens: int, n_slots: int, n_sub: int, rank: int) -> KernelPath:
    """The path a step of n_tokens tokens takes, over buffers of n_slots slots of n_sub
    sub-projections of rank `rank`."""
    threshold = envs.SHOAL_LORA_SEGMENTED_MIN_TOKENS.get() or SEGMENTED_MIN_TOKENS
    if n_tokens >= threshold and lora_segmented.supports(n_slots, n_sub, rank):
        return "segmented"
    return "split_k"


def add_lora(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor,
             sub_offsets: tuple[int, ...], rank: int, path: KernelPath | None = None) -> None:
    """In place: y[t] += the LoRA delta of token t's adapter (nothing for slot -1). Same
    arguments as lora_torch.add_lora; every tensor on one device, each contiguous along its
    last dim, x, y, a and b of one dtype among float16, bfloat16 and float32. path: the
    kernels to run (None: choose_path's pick; set by tests and benchmarks)."""
    bounds = check_args(y, x, a, b, token_slots, sub_offsets, rank)
    n_sub = len(bounds)
    if n_sub > MAX_SUBS:
        raise ValueError(f"{n_sub} sub-projections: the Triton LoRA kernels take at most "
                         f"{MAX_SUBS}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}: expected one of {_DTYPES}")
    for name, t in (("x", x), ("y", y), ("a", a), ("b", b)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous along its last dim, got strides "
                             f"{t.stride()}")
    if len({t.device for t in (x, y, a, b, token_slots)}) != 1:
        raise ValueError("x, y, a, b and token_slots must be on one device")
    n_tokens, out = y.shape
    if path is None:
        path = choose_path(n_tokens, a.shape[0], n_sub, rank)
    elif path not in ("split_k", "segmented"):
        raise ValueError(f"path must be 'split_k' or 'segmented', got {path!r}")
    elif path == "segmented" and not lora_segmented.supports(a.shape[0], n_sub, rank):
        raise ValueError(f"the segmented path takes at most {lora_segmented.MAX_SLOTS} slots "
                         f"and ranks up to 64: the buffers hold {a.shape[0]} slots of "
                         f"{n_sub} sub-projections of rank {rank}")
    if n_tokens == 0:
        return
    starts = [lo for lo, _ in bounds[1:]] + [out] * (MAX_SUBS - n_sub)
    run = lora_segmented.add_lora_segmented if path == "segmented" else add_lora_split_k
    run(y, x, a, b, token_slots, starts, n_sub, rank)

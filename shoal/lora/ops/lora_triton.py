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

- fused (lora_fused_decode.py), for steps of at most FUSED_MAX_TOKENS tokens on a GPU where
  it times faster: shrink and expand in one launch, each program computing the whole shrink
  its rows need (A re-read from L2 by every program). At batch 1 the split-K pair is two
  latency-bound launches per projection; which of the two is faster depends on the shape
  (the input features each program's shrink walks) and the GPU, so the first call of a shape
  outside a CUDA-graph capture times both (launch_tuner.run_fastest: the engine's warm-up
  runs each captured shape eagerly first) and keeps the faster for the process. Until then,
  during a capture, on the CPU or with SHOAL_QUANT_TUNING=0, split-K runs.

Tokens whose slot is -1 are left alone by every path. A slot >= S is not checked (that
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
from shoal.layers.quantization import launch_tuner
from shoal.lora.ops import lora_segmented
from shoal.lora.ops.lora_fused_decode import add_lora_fused_decode
from shoal.lora.ops.lora_split_k import add_lora_split_k
from shoal.lora.ops.lora_torch import check_args

MAX_SUBS = 4  # the expand kernels compare a row with three sub-projection starts
# Steps of at least this many tokens take the segmented path: a module attribute, which
# benchmarks/lora_gpu.py --segmented-min-tokens sets (in process) to sweep it.
# H100, 2026-12-05 (benchmarks/results/2026-12-05-lora-3f3ee93-H100.json): at 32 tokens
# split-K was faster in 7 of 8 projection x adapter-count rows, at 64 segmented in all 8.
SEGMENTED_MIN_TOKENS = 64
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KernelPath = Literal["split_k", "segmented", "fused"]
_RUNS = {"split_k": add_lora_split_k, "segmented": lora_segmented.add_lora_segmented,
         "fused": add_lora_fused_decode}
# Steps of at most this many tokens (and ranks up to FUSED_MAX_RANK) time the fused path
# against split-K on a GPU: each fused program re-reads A, so its traffic grows with both.
FUSED_MAX_TOKENS = 4
FUSED_MAX_RANK = 64
DECODE_CANDIDATES = ("split_k", "fused")  # split-K first: the reference the tuner checks


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
    kernels to run (None: choose_path's pick, or at a few tokens on a GPU decode_path's;
    set by tests and benchmarks)."""
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
    starts = starts_of(bounds, out)
    if path is None:
        path = choose_path(n_tokens, a.shape[0], n_sub, rank)
        if path == "split_k" and 0 < n_tokens <= FUSED_MAX_TOKENS and rank <= FUSED_MAX_RANK \
                and x.device.type == "cuda":
            path = decode_path(y, x, a, b, starts, n_sub, rank)
    elif path not in _RUNS:
        raise ValueError(f"path must be one of {sorted(_RUNS)}, got {path!r}")
    elif path == "segmented" and not lora_segmented.supports(a.shape[0], n_sub, rank):
        raise ValueError(f"the segmented path takes at most {lora_segmented.MAX_SLOTS} slots "
                         f"and ranks up to 64: the buffers hold {a.shape[0]} slots of "
                         f"{n_sub} sub-projections of rank {rank}")
    if n_tokens == 0:
        return
    _RUNS[path](y, x, a, b, token_slots, starts, n_sub, rank)


def starts_of(bounds: list[tuple[int, int]], out: int) -> list[int]:
    """The first rows of sub-projections 1..3, out where there is none (the kernels'
    starts argument)."""
    return [lo for lo, _ in bounds[1:]] + [out] * (MAX_SUBS - len(bounds))


def decode_key(y: Tensor, x: Tensor, a: Tensor, n_sub: int, rank: int) -> tuple:
    """launch_tuner's key of a few-token step: the shape, the token count and the slots."""
    return ("lora_decode", x.shape[1], y.shape[1], n_sub, rank, y.shape[0], x.dtype,
            a.shape[0])


def decode_path(y: Tensor, x: Tensor, a: Tensor, b: Tensor, starts: list[int], n_sub: int,
                rank: int) -> KernelPath:
    """The faster of DECODE_CANDIDATES for this step's key: a dict look-up once timed (this
    runs per adapted projection and step in eager mode). An untimed key is timed when
    launch_tuner may (a GPU, no capture under way, SHOAL_QUANT_TUNING on); otherwise split-K,
    the reference, runs without adding a timing launch to a graph being captured.

    The candidates run on scratch outputs and one slot of random adapter weights, never on
    y or the slots: each computes the delta alone (y = 0) of every token on that slot,
    whatever this step's slots are (a warm-up step has none, and a token of slot -1 costs
    nothing on either path), so the timing is of the work a step of adapted tokens does and
    the agreement check compares real deltas, not zeros or deltas buried in y."""
    key = decode_key(y, x, a, n_sub, rank)
    known = launch_tuner.TUNED.get(key)
    if known is not None:
        return known.choice
    # (checked here: run_fastest would otherwise launch the reference on a scratch output,
    # inside a graph being captured)
    if not launch_tuner.may_time(x.device):
        return DECODE_CANDIDATES[0]
    every_on_slot_0 = torch.zeros(y.shape[0], dtype=torch.int32, device=y.device)
    # One slot of random adapter weights: the slots' own may still be zero at warm-up (no
    # adapter loaded yet), and the agreement check must compare real deltas.
    g = torch.Generator(device=x.device).manual_seed(0)
    a1 = (torch.randn(1, *a.shape[1:], generator=g, device=a.device) * 0.05).to(a.dtype)
    b1 = (torch.randn(1, *b.shape[1:], generator=g, device=b.device) * 0.05).to(b.dtype)

    def delta(name: str) -> Tensor:
        scratch = torch.zeros_like(y)
        _RUNS[name](scratch, x, a1, b1, every_on_slot_0, starts, n_sub, rank)
        return scratch

    launch_tuner.run_fastest(key, DECODE_CANDIDATES, delta, x.device,
                             launch_tuner.EXACT_OPERANDS_AGREE)
    known = launch_tuner.TUNED.get(key)
    return known.choice if known is not None else DECODE_CANDIDATES[0]

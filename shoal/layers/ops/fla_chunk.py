"""Prefill chunks of linear attention on CUDA through fla-core's chunked Triton kernels
(flash-linear-attention, pinned fla-core==0.6.0: the library vLLM and SGLang take these
kernels from): chunk_gated_delta_rule for Gated DeltaNet (value heads grouped over key
heads in the kernel) and chunk_kda for Kimi Delta Attention's per-channel decay. Where
fla-core is not installed (the CPU, CI) the torch chunked rule runs
(shoal/layers/ops/gated_delta_rule.py)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _kernels() -> tuple[Callable, Callable] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
        logger.info("fla-core is not usable (%s): prefill chunks of linear attention run the "
                    "torch chunked rule", e)
        return None
    return chunk_gated_delta_rule, chunk_kda


def usable(x: torch.Tensor) -> bool:
    return x.is_cuda and _kernels() is not None


def chunk_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [T, Hk, Dk] (not normed), v [T, H, Dv], g [T, H] or [T, H, Dk]
    (log decay, float32), beta [T, H]; state [H, Dk, Dv] float32 before the first token.
    Returns (o [T, H, Dv] float32, the state after the last token)."""
    kernels = _kernels()
    assert kernels is not None
    gdn, kda = kernels
    rule = kda if g.dim() == 3 else gdn
    o, final = rule(q[None], k[None], v[None], g[None].float(), beta[None].to(v.dtype),
                    scale=scale, initial_state=state[None].float().contiguous(),
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0].float(), final[0]


def block_end_segments(length: int, offset: int, block_size: int) -> list[tuple[int, int]]:
    """[start, end) pieces of a chunk of `length` tokens from absolute position `offset`,
    cut after every token that ends a block (the prefix cache's snapshots)."""
    cuts, start = [], 0
    first_end = block_size - offset % block_size  # tokens up to the first block end
    for end in range(first_end, length, block_size):
        cuts.append((start, end))
        start = end
    cuts.append((start, length))
    return cuts

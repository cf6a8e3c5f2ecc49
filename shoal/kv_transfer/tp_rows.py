"""A tensor-parallel producer's saved KV: each rank reads its own KV heads' rows (and its
linear layers' states) out of its own cache, and TP rank 0 gathers them into one payload
holding every KV head once, as a one-rank producer's; a consumer of any TP size then takes
its own heads of it (rows.scatter_rows), so the two sides' TP sizes need not match.

A layer's KV heads are split over the ranks (rank r holds heads [r * local, (r + 1) *
local)) unless the model has fewer KV heads than ranks: then `replicas` consecutive ranks
hold the same head (QKVParallelLinear) and rank 0 keeps one of each run. A latent (MLA) row
is held whole by every rank: rank 0's own is the payload's. A linear layer's state is this
rank's channels' conv and heads' delta-rule state: gathered here one a rank (rank-major,
one "head" per rank), it goes into the payload in the model's order (states.py:
to_model_order), whose slices a consumer rank of any TP size takes (states.rank_share)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shoal.core.kv_cache_spec import KVCacheSpec, LinearStateSpec
from shoal.distributed.parallel_state import tp_gather_to_first


def model_kv_heads(hf_config: Any) -> int | None:
    """The model's KV heads (all ranks together), from its (text) config; None if unknown."""
    if hf_config is None:
        return None
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return (getattr(text, "num_key_value_heads", None)
            or getattr(text, "num_attention_heads", None))


def kv_head_replicas(specs: Sequence[KVCacheSpec], total_kv_heads: int | None,
                     world: int) -> tuple[int, ...]:
    """Per paged layer: how many consecutive TP ranks hold the same rows (1: each its own
    heads; `world`: every rank all of them)."""
    out = []
    for spec in specs:
        if world == 1 or isinstance(spec, LinearStateSpec):
            out.append(1)
        elif spec.planes == 1:  # a latent row (MLA, indexer keys): no heads to split
            out.append(world)
        elif spec.num_kv_heads == 1 and total_kv_heads and total_kv_heads < world:
            out.append(world // total_kv_heads)
        else:
            out.append(1)
    return tuple(out)


def gather_to_first(local: list[torch.Tensor], replicas: Sequence[int]
                    ) -> list[torch.Tensor] | None:
    """Per layer [planes, rows, heads, width] uint8: every rank's `local` rows of it (this
    rank's heads), gathered on TP rank 0 into every distinct head once, in head order (one
    gather for all layers); None on the other ranks. Every rank of the group must call it."""
    flat = torch.cat([t.reshape(-1) for t in local])
    parts = tp_gather_to_first(flat)
    if parts is None:
        return None
    out, offset = [], 0
    for t, rep in zip(local, replicas):
        size = t.numel()
        if rep > 1 and len(parts) % rep:
            raise ValueError(f"{rep} ranks a head does not divide {len(parts)} ranks")
        mine = [p[offset:offset + size].view(t.shape) for r, p in enumerate(parts)
                if r % rep == 0]
        out.append(mine[0] if len(mine) == 1 else torch.cat(mine, dim=2))
        offset += size
    return out

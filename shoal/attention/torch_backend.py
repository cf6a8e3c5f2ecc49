"""Reference attention over the paged KV cache in plain PyTorch.

Per layer: write the new keys/values into their slots, then gather each request's context
from the cache and run scaled-dot-product attention, decodes as one batch and prefill chunks
as another. Writing before reading lets a request read blocks that another request in the
same step is filling (prefix-cache hits on blocks computed in this very step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.attention.metadata import AttentionMetadata


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_slots, Hk, D]; k, v: [T, Hk, D]."""
    kv_cache[0].index_copy_(0, slot_mapping, k)
    kv_cache[1].index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hk, D]. Returns [T, Hq, D]."""
    write_kv_cache(kv_cache, k, v, md.slot_mapping)
    out = torch.empty_like(q)
    nd = md.num_decodes
    if nd:
        out[:nd] = _attend(q[:nd].unsqueeze(1), kv_cache, md.decode_slots, md.decode_mask,
                           scale).squeeze(1)
    if md.num_prefills:
        qp = q[md.prefill_token_index]  # [P, Lq, Hq, D]
        o = _attend(qp, kv_cache, md.prefill_slots, md.prefill_mask, scale)
        out[md.prefill_token_index[md.prefill_token_valid]] = o[md.prefill_token_valid]
    return out


def _attend(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q: [B, Lq, Hq, D]; slots: [B, Lk]; mask: [B, 1, Lq, Lk]. Returns [B, Lq, Hq, D]."""
    k = kv_cache[0][slots]  # [B, Lk, Hk, D]
    v = kv_cache[1][slots]
    hq, hk = q.shape[2], k.shape[2]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=2)
        v = v.repeat_interleave(hq // hk, dim=2)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return o.transpose(1, 2)

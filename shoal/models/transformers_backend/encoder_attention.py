"""Bidirectional attention over a pooling step's packed prompts, for encoder-only models run
by the Transformers backend (encoder.py).

transformers' attention modules hand the attention function query [1, H, T, D] and key/value
[1, Hk, T, D] for the step's prompts back to back (attention.py dispatches here while a
PackedStep is current). Each prompt attends to itself only: attention runs once per run of
equal-length prompts (shoal/attention/packed.py), optionally within the module's
bidirectional sliding window (ModernBERT's local layers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.attention.packed import PackedSeqs, packed_attention


@dataclass(frozen=True)
class PackedStep:
    """What an encoder's attention calls read during one pooling forward."""

    seqs: PackedSeqs


def packed_bidirectional(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         seqs: PackedSeqs, scaling: float | None,
                         sliding_window: int | None) -> torch.Tensor:
    """query [1, H, T, D], key/value [1, Hk, T, D] (Hk divides H) -> [1, T, H, D], the
    layout transformers' attention functions return. sliding_window: transformers' flash
    convention, a token sees the ones less than `sliding_window` positions away."""
    if query.shape[0] != 1:
        raise ValueError(f"shoal runs a pooling step as one packed sequence (got batch "
                         f"{query.shape[0]})")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1).to(q.dtype)
    v = value[0].transpose(0, 1).to(q.dtype)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if seqs.causal:
        raise ValueError("an encoder's pooling step must be built bidirectional "
                         "(PackedSeqs.causal is True)")
    longest = max(seqs.seq_lens, default=0)
    if not sliding_window or longest <= sliding_window:  # the window spans each prompt
        return packed_attention(q, k, v, seqs, scale).unsqueeze(0)
    outs = []
    for start, b, n in seqs.runs:
        sl = slice(start, start + b * n)
        qb, kb, vb = (x[sl].unflatten(0, (b, n)).transpose(1, 2) for x in (q, k, v))
        idx = torch.arange(n, device=q.device)
        band = (idx[:, None] - idx[None, :]).abs() < sliding_window
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=band, scale=scale,
                                           enable_gqa=kb.shape[1] != qb.shape[1])
        outs.append(o.transpose(1, 2).reshape(b * n, *o.shape[1:2], o.shape[-1]))
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).unsqueeze(0)

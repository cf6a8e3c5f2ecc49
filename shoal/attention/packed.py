"""Attention over packed variable-length sequences with no KV cache (pooling models).

The step's tokens are one [T, ...] tensor, sequences back to back, no padding. Linear layers
run on the packed tensor directly; attention runs once per distinct sequence length: the
sequences of one length are gathered into a dense [B, H, L, D] batch for one
`scaled_dot_product_attention` call, then scattered back. On the CPU this wastes nothing on
padding (a padded batch pays for the longest sequence in every row), needs no mask (SDPA's
fused CPU kernel only runs unmasked), and takes a handful of calls per layer where one call
per sequence would take hundreds. Causal for decoder models used as embedders,
bidirectional for encoders."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PackedSeqs:
    """The attention metadata of a pooling step."""

    seq_lens: list[int]
    causal: bool
    # (length, [B, L] flat token indices of the B sequences of that length)
    groups: list[tuple[int, torch.Tensor]]
    token_type_ids: torch.Tensor | None = None  # [T], BERT segment ids (cross-encoder pairs)

    @classmethod
    def build(cls, seq_lens: list[int], causal: bool, device: torch.device,
              token_type_ids: list[int] | None = None) -> PackedSeqs:
        starts: dict[int, list[int]] = {}
        pos = 0
        for n in seq_lens:
            starts.setdefault(n, []).append(pos)
            pos += n
        groups = []
        for n, s in sorted(starts.items()):
            first = torch.tensor(s, dtype=torch.long)
            idx = first[:, None] + torch.arange(n, dtype=torch.long)[None, :]
            groups.append((n, idx.to(device, non_blocking=True)))
        tt = (torch.tensor(token_type_ids, dtype=torch.long).to(device)
              if token_type_ids is not None else None)
        return cls(list(seq_lens), causal, groups, tt)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs,
                     scale: float) -> torch.Tensor:
    """q: [T, H, D], k and v: [T, Hk, D] (Hk divides H) -> [T, H, D]."""
    gqa = k.shape[1] != q.shape[1]
    if len(seqs.groups) == 1 and seqs.groups[0][1].shape[0] == 1:  # one sequence: no gather
        o = _sdpa(q[None], k[None], v[None], seqs.causal, scale, gqa)
        return o[0]
    out = torch.empty_like(q)
    for _, idx in seqs.groups:
        o = _sdpa(q[idx], k[idx], v[idx], seqs.causal, scale, gqa)  # [B, L, H, D]
        out[idx] = o
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
          gqa: bool) -> torch.Tensor:
    """[B, L, H, D] in and out."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=causal, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)

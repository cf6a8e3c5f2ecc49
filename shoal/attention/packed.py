"""Attention over packed variable-length sequences with no KV cache (pooling models).

The step's tokens are one [T, ...] tensor, sequences back to back, no padding. Linear layers
run on the packed tensor directly. Attention runs once per run of consecutive sequences of
equal length: such a run is a contiguous [B * L] slice, viewed (not copied) as a dense
[B, L, H, D] batch for one `scaled_dot_product_attention` call. The pooling runner orders a
step's prompts by length, so a step takes one call per distinct length.

Why this on the CPU: a padded batch pays for the longest sequence in every row; a
block-diagonal mask over the whole packed step pays T^2 and keeps SDPA off its fused
(unmasked) CPU kernel; a gather per length group costs a strided index copy of q, k and v
(measured: more than the attention itself); one call per sequence costs hundreds of small
calls per layer. Runs of equal length need none of these. Causal for decoder models used
as embedders, bidirectional for encoders."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PackedSeqs:
    """The attention metadata of a pooling step."""

    seq_lens: list[int]
    causal: bool
    runs: list[tuple[int, int, int]]  # (first token, sequences B, length L), contiguous
    token_type_ids: torch.Tensor | None = None  # [T], BERT segment ids (cross-encoder pairs)

    @classmethod
    def build(cls, seq_lens: list[int], causal: bool, device: torch.device,
              token_type_ids: list[int] | None = None) -> PackedSeqs:
        runs: list[tuple[int, int, int]] = []
        pos = 0
        for n in seq_lens:
            if runs and runs[-1][2] == n:
                start, b, _ = runs[-1]
                runs[-1] = (start, b + 1, n)
            else:
                runs.append((pos, 1, n))
            pos += n
        tt = (torch.tensor(token_type_ids, dtype=torch.long).to(device)
              if token_type_ids is not None else None)
        return cls(list(seq_lens), causal, runs, tt)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs,
                     scale: float) -> torch.Tensor:
    """q: [T, H, D], k and v: [T, Hk, D] (Hk divides H) -> [T, H, D]."""
    gqa = k.shape[1] != q.shape[1]
    outs = []
    for start, b, n in seqs.runs:
        sl = slice(start, start + b * n)
        qb = q[sl].unflatten(0, (b, n)).transpose(1, 2)  # [B, H, L, D]
        kb = k[sl].unflatten(0, (b, n)).transpose(1, 2)
        vb = v[sl].unflatten(0, (b, n)).transpose(1, 2)
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=seqs.causal, scale=scale,
                                           enable_gqa=gqa)
        outs.append(o.transpose(1, 2).reshape(b * n, *o.shape[1:2], o.shape[-1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)

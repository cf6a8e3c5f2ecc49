"""DeepSeek-V4's compressor: one KV entry per complete group of `ratio` tokens (CSA: m = 4,
HCA: m' = 128), the softmax-gated sum of the group's projected rows.

Each token contributes kv_proj(h) and gate_proj(h) (its "row", what the paged cache keeps:
shoal/layers/paged_rows.py); entry w pools the rows of tokens [w m, (w + 1) m) with weights
softmax(gate + position_bias) over the group, then an RMSNorm and RoPE at position w m. CSA
overlaps its groups: its projections are twice as wide, the first half (Ca) of a group also
feeds the next group's entry beside that group's second half (Cb), so entry w pools 2m rows
(entry 0's Ca half is empty).

This first version recomputes every entry of a request from its cached rows at each step
(`compress`), which needs no state beyond the per-token rows, so prefix hits, chunked
prefill and preemption stay exact; it does not save the memory the compression is for (the
rows are wider than the entries they pool): a cache of the entries themselves is the GPU
path's job."""

from __future__ import annotations

import torch
from torch import nn

from shoal.layers.interleaved_rope import InterleavedRope
from shoal.layers.linear import ReplicatedLinear
from shoal.layers.norm import RMSNorm


class TokenCompressor(nn.Module):
    def __init__(self, hidden_size: int, head_dim: int, ratio: int, overlap: bool, eps: float,
                 rope: InterleavedRope, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = ReplicatedLinear(hidden_size, width, params_dtype=dtype)
        self.gate_proj = ReplicatedLinear(hidden_size, width, params_dtype=dtype)
        # float32, as transformers keeps it (it is added to the gate logits)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32),
                                          requires_grad=False)
        self.kv_norm = RMSNorm(head_dim, eps, dtype, use_triton_ops)
        self.rope = rope  # the "compress" table, shared with its attention layer
        self.row_width = 2 * width

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> each token's row [T, row_width]: kv, then gate."""
        return torch.cat([self.kv_proj(hidden), self.gate_proj(hidden)], dim=-1)

    def compress(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of a request's first n * ratio tokens -> its n entries [n, head_dim]."""
        m = self.ratio
        n = rows.shape[0] // m
        kv, gate = rows[:n * m].view(n, m, self.row_width).chunk(2, dim=-1)
        gate = gate + self.position_bias
        if self.overlap:
            kv, gate = self._overlapped(kv, gate)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(dim=1))
        positions = torch.arange(n, device=rows.device) * m
        return self.rope.rotate(entries, *self.rope.cos_sin(positions))

    def _overlapped(self, kv: torch.Tensor, gate: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, m, 2D] -> [n, 2m, D]: group w's Cb rows after group w - 1's Ca rows (none
        for w = 0: zero rows with a -inf gate, which the softmax weighs 0)."""
        n, m, d = kv.shape[0], self.ratio, self.head_dim
        out_kv = kv.new_zeros(n, 2 * m, d)
        out_gate = gate.new_full((n, 2 * m, d), float("-inf"))
        out_kv[:, m:], out_gate[:, m:] = kv[..., d:], gate[..., d:]
        out_kv[1:, :m], out_gate[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
        return out_kv, out_gate

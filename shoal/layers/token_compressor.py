"""DeepSeek-V4's compressor: one KV entry per complete group of `ratio` tokens (CSA: m = 4,
HCA: m' = 128), the softmax-gated sum of the group's projected rows.

Each token contributes kv_proj(h) and gate_proj(h) (its "row"); entry w pools the rows of
tokens [w m, (w + 1) m) with weights softmax(gate + position_bias) over the group, then an
RMSNorm and RoPE at position w m. CSA overlaps its groups: its projections are twice as wide,
the first half (Ca) of a group also feeds the next group's entry beside that group's second
half (Cb), so entry w pools 2m rows (entry 0's Ca half is empty).

An entry is computed once, by the step that closes its group (`compress` over that group's
rows, and the group before for the overlap), and kept (shoal/layers/paged_entries.py); the
rows of the groups still open wait in a sliding cache (CompressorStateSpec,
shoal/layers/paged_rows.py), so a chunk or a prefix hit ending inside a group resumes it from
the rows of its tokens."""

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

    @property
    def groups_before(self) -> int:
        """Earlier groups whose rows an entry pools beside its own (CSA's overlap)."""
        return int(self.overlap)

    def compress(self, rows: torch.Tensor, first: int = 0) -> torch.Tensor:
        """The rows of groups [first, first + n) -> their n entries [n, head_dim]. With CSA's
        overlap the first entry lacks its earlier group's half: right for group 0, else the
        caller passes one group more than it needs and drops that entry."""
        m = self.ratio
        n = rows.shape[0] // m
        kv, gate = rows[:n * m].view(n, m, self.row_width).chunk(2, dim=-1)
        gate = gate + self.position_bias
        if self.overlap:
            kv, gate = self._overlapped(kv, gate)
        return self._pool(kv, gate, torch.arange(first, first + n, device=rows.device))

    def compress_closing(self, rows: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """A batch of requests closing one group each: rows [n, (1 + groups_before) m,
        row_width] (with CSA's overlap the group before's rows, then the group's), groups [n]
        the groups' indices -> their entries [n, head_dim]. A group 0 has no group before:
        those rows are left out (zero, with a -inf gate), as compress leaves them."""
        n, m, d = rows.shape[0], self.ratio, self.head_dim
        kv, gate = rows.view(n, 1 + self.groups_before, m, self.row_width).chunk(2, dim=-1)
        gate = gate + self.position_bias
        if not self.overlap:
            return self._pool(kv[:, 0], gate[:, 0], groups)
        first = (groups == 0)[:, None, None]
        kv = torch.cat([kv[:, 0, :, :d].masked_fill(first, 0), kv[:, 1, :, d:]], dim=1)
        gate = torch.cat([gate[:, 0, :, :d].masked_fill(first, float("-inf")),
                          gate[:, 1, :, d:]], dim=1)
        return self._pool(kv, gate, groups)

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """kv, gate [n, rows, head_dim] of n groups (their indices `groups` [n]) -> the entries
        [n, head_dim]: the softmax-gated sum, normed, rotated at each group's first token."""
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(dim=1))
        return self.rope.rotate(entries, *self.rope.cos_sin(groups * self.ratio))

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

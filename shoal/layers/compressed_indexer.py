"""DeepSeek-V4's lightning indexer: which compressed entries of a CSA layer each query reads.

It is a compressor of its own (the CSA layer's groups, at index_head_dim: its keys are
compressed entries too, computed when a group closes and kept beside the layer's entry,
shoal/layers/token_compressor.py) plus a query head: n_heads queries per token from the
attention's query latent (q_b_proj of q_a's output, rotated at the token's position with the
"compress" table), and per-token head weights (weights_proj / sqrt(n_heads)). A query scores entry s as
sum_h w_h * relu(q_h . k_s) / sqrt(index_head_dim) and reads its index_topk best among the
entries it may see (every one of them when it sees fewer). On CUDA a batch of decodes scores
in a Triton kernel reading the keys from the cache (pick_rows), and so do the tokens of
prefill chunks and verify steps, each a row of its own.

SparseCompressor is the CSA layer's compressor holding its indexer (transformers' layout:
`self_attn.compressor.indexer`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from shoal.layers.interleaved_rope import InterleavedRope
from shoal.layers.linear import ReplicatedLinear
from shoal.layers.score_pieces import (
    RowRun,
    capturing,
    cut_pieces,
    fixed_pieces,
    top_k_in_pieces,
)
from shoal.layers.token_compressor import TokenCompressor

if TYPE_CHECKING:
    from shoal.attention.ops.v4_decode_attention import PagedKeys

# float32 scores [rows, entries] and top-k outputs (3 a pick) one pick_rows piece holds:
# 256 MiB (a 16k-token chunk over 128k tokens of context would otherwise score 2^29 at once)
SCORE_ELEMENTS = 1 << 26


class CompressedIndexer(TokenCompressor):
    def __init__(self, cfg: Any, ratio: int, rope: InterleavedRope, dtype: torch.dtype,
                 use_triton_ops: bool = True):
        super().__init__(cfg.hidden_size, cfg.index_head_dim, ratio, True, cfg.rms_norm_eps,
                         rope, dtype, use_triton_ops)
        if cfg.index_topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {cfg.index_topk}")
        self.n_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = ReplicatedLinear(cfg.q_lora_rank, self.n_heads * self.head_dim,
                                         params_dtype=dtype)
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, self.n_heads, params_dtype=dtype)
        self.scale = self.head_dim ** -0.5
        self.query_dtype = dtype  # the queries' values, before queries() widens them

    def queries(self, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotated queries [T, H, D] and head weights [T, H], float32 (cos, sin:
        the tokens' "compress" angles)."""
        q = self.q_b_proj(q_resid).view(hidden.shape[0], self.n_heads, self.head_dim)
        q = self.rope.rotate(q, cos, sin).float()
        return q, self.weights_proj(hidden).float() * self.n_heads ** -0.5

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """q [n, H, D], weights [n, H], keys [N, D] (this request's compressed keys; or
        [n, N, D]: each query's own, a batch of decodes), visible [n, N] -> bool [n, N]: the
        entries each query reads."""
        picked, seen = self.pick(q, weights, keys, visible)
        out = torch.zeros_like(visible)
        return out.scatter_(-1, picked, seen)

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """As select's arguments -> each query's score of each entry [n, N] float32, -inf
        where it may not see it."""
        keys = keys.float().transpose(-1, -2)
        scores = F.relu(torch.matmul(q, keys)) * self.scale  # [n, H, N]
        return (scores * weights.unsqueeze(-1)).sum(dim=1).masked_fill(~visible, float("-inf"))

    def pick(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
             visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As select, the entries each query reads as indices [n, k] (k = min(index_topk,
        N): a fixed shape) and whether each is one it may see [n, k] (not, where it sees
        fewer than k)."""
        scores = self.scores(q, weights, keys, visible)
        picked = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        return picked, visible.gather(-1, picked)

    def pick_rows(self, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                  entries: PagedKeys, key_column: int, block_size: int,
                  table_rows: torch.Tensor | None = None,
                  row_runs: Sequence[RowRun] | None = None) -> torch.Tensor | None:
        """The Triton path (shoal/attention/ops/v4_index_scores.py) of rows (decodes, or the
        tokens of prefill chunks and verify steps): q [R, H, D] and weights [R, H] at
        positions [R], the entries' cache (this indexer's keys at key_column) and tables
        ([R, N], or any rows with table_rows [R] saying each row's) -> the entries each reads
        [R, index_topk] int32, sorted best first (its own before any it may not see: those
        score -inf), or None when the tables hold no more than index_topk entries (every one
        is read: no scores, no top-k). The rows are scored in pieces whose scores and top-k
        outputs stay within SCORE_ELEMENTS (shoal/layers/score_pieces.py): without row_runs
        the pieces follow the shapes only, so a decode graph replays them; with them (the
        rows' lengths on the host: an eager step's spans) each piece reads only the table
        columns its rows reach."""
        columns = entries.tables.shape[1]
        if columns * block_size // self.ratio <= self.topk:
            return None
        # lossless (q holds query_dtype's values): tensor-core products over pages of that
        # dtype, or over FP8 pages (e4m3 is exact in bf16/fp16: v4_index_scores.py)
        half = self.query_dtype in (torch.bfloat16, torch.float16)
        if entries.pages.dtype == self.query_dtype or (half and entries.fp8 is not None):
            q = q.to(self.query_dtype)
        shape = (columns, block_size, self.ratio, self.topk, SCORE_ELEMENTS)
        if row_runs is None or capturing(q.device):
            pieces = fixed_pieces(q.shape[0], *shape)
        else:
            pieces = cut_pieces(row_runs, q.shape[0], *shape)
        return top_k_in_pieces(pieces, q, weights, positions, entries, table_rows, key_column,
                               self.ratio, block_size, self.scale, self.topk)


class SparseCompressor(TokenCompressor):
    """A CSA layer's compressor (overlapping groups of `ratio` tokens) with its indexer."""

    def __init__(self, cfg: Any, ratio: int, rope: InterleavedRope, dtype: torch.dtype,
                 use_triton_ops: bool = True):
        super().__init__(cfg.hidden_size, cfg.head_dim, ratio, True, cfg.rms_norm_eps, rope,
                         dtype, use_triton_ops)
        self.indexer = CompressedIndexer(cfg, ratio, rope, dtype, use_triton_ops)

"""DeepSeek-V3.2's lightning indexer (shoal/layers/sparse_indexer.py) on the Triton backend's
metadata: the index_topk cached tokens each query row of the step reads, as SparseRows for
the sparse latent-attention kernel (shoal/attention/ops/mla_sparse.py).

Every row of the step is a query, decodes and prefill tokens alike: its request (the block-table
row holding it, from query_start_loc) and its position + 1 (from its request's seq_len and
query end) are computed on the device. Its scores over every position its request's table
holds come from the index-score kernel (attention/ops/v4_index_scores.py, whose entries at
ratio 1 are the tokens themselves: it reads the keys straight from the paged key cache), -inf
past the row's own, and torch.topk keeps the best index_topk in order, so a row's visible picks
lead. Nothing is read back to the host and the shapes follow the token count and table width:
a captured decode (or verify) graph replays it. Rows are scored in pieces whose scores and top-k
outputs stay within SCORE_ELEMENTS (shoal/layers/score_pieces.py), so a long prefill chunk over
a long context does not hold every row's scores at once; an eager step (its metadata's host_lens)
scores each piece only over the table columns its rows reach. An FP8 key
cache (kv_cache_dtype="fp8": block-scaled rows, attention/fp8_rows.py) is read with its rows'
layout: a bf16/fp16 model's queries score it on tensor cores (e4m3 converted exactly, each
key's scale times its float32 dot), a float32 model's dequantize it in the kernel as the torch
path does (v4_index_scores.py)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from shoal.attention.fp8_rows import BlockScaledRows
from shoal.attention.ops.mla_sparse import SparseRows
from shoal.attention.ops.v4_decode_attention import PagedKeys
from shoal.layers.score_pieces import (
    RowRun,
    ScorePiece,
    capturing,
    cut_pieces,
    fixed_pieces,
    top_k_in_pieces,
)

# float32 scores [rows, positions] and top-k outputs (3 a pick) held at once: 256 MiB
SCORE_ELEMENTS = 1 << 26


def query_rows(md: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(table_rows [T] int32, seen [T] int32) of the step's T query rows: each row's request
    and how many keys it may see (its position + 1; 0 on a decode padding row, whose seq_len is
    0). md: the Triton backend's metadata, one query_start_loc entry per table row."""
    t = md.num_tokens
    device = md.seq_lens.device
    if not md.num_prefills:  # decodes (padded): row r is request r, its seq_len r's
        return torch.arange(t, dtype=torch.int32, device=device), md.seq_lens[:t]
    rows = md.num_decode_rows + md.num_prefills
    ends = md.query_start_loc[1:rows + 1]
    tok = torch.arange(t, dtype=torch.int32, device=device)
    req = torch.searchsorted(ends, tok, right=True, out_int32=True)
    # a request's last query sits at seq_len - 1, the others before it
    seen = md.seq_lens[req] - ends[req] + tok + 1
    return req, seen.to(torch.int32)


def pick_rows(q: torch.Tensor, weights: torch.Tensor, md: Any, pages: torch.Tensor, topk: int,
              scale: float, fp8: BlockScaledRows | None = None) -> SparseRows:
    """q [T, Hi, Di] (the indexer's rotated queries), weights [T, Hi] (its head weights,
    float32), md the step's Triton metadata, pages [blocks, block_size, Di] the key cache
    (every row of the step already written; fp8: its rows' layout when they are stored as
    block-scaled FP8, pages then [blocks, block_size, fp8.row_bytes] bytes) -> the top-k
    positions of each row (int32), best first, with the rows' requests and counts. Needs
    tables of more than topk positions."""
    table_rows, seen = query_rows(md)
    t = q.shape[0]
    width = md.block_tables.shape[1] * md.block_size
    if width <= topk:
        raise ValueError(f"tables of {width} positions need no selection (index_topk {topk})")
    picks = top_k_in_pieces(score_pieces(md, t, topk, q.device), q, weights, seen - 1,
                            PagedKeys(pages, md.block_tables, fp8),
                            table_rows if md.num_prefills else None, 0, 1, md.block_size,
                            scale, topk)
    return SparseRows(picks, seen, table_rows)


def score_pieces(md: Any, rows: int, topk: int, device: torch.device
                 ) -> Sequence[ScorePiece]:
    """The pieces of the step's rows scored at once: in an eager step (host_lens: each table
    row's query and context lengths) over the columns each piece's rows reach, else (graph
    metadata, or a capture) in fixed shapes over the whole tables."""
    columns, bs = md.block_tables.shape[1], md.block_size
    lens = getattr(md, "host_lens", None)
    if lens is None or capturing(device):
        return fixed_pieces(rows, columns, bs, 1, topk, SCORE_ELEMENTS)
    return _cut_pieces(lens, rows, columns, bs, topk, SCORE_ELEMENTS)


@functools.lru_cache(maxsize=8)
def _cut_pieces(lens: tuple[tuple[int, int], ...], rows: int, columns: int, block_size: int,
                topk: int, budget: int) -> tuple[ScorePiece, ...]:
    """cut_pieces of rows of (query tokens, context) `lens`, kept for the step's other layers
    (a few hundred requests take a few tenths of a millisecond)."""
    runs = [RowRun(n, c + 1) for n, c in lens]
    return tuple(cut_pieces(runs, rows, columns, block_size, 1, topk, budget))

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
a captured decode (or verify) graph replays it. Rows are scored SCORE_ELEMENTS at a time, so a
long prefill chunk over a long context does not hold every row's scores at once. An FP8 key
cache (kv_cache_dtype="fp8": block-scaled rows, attention/fp8_rows.py) is read with its rows'
layout, dequantized in the kernel as the torch path dequantizes it."""

from __future__ import annotations

from typing import Any

import torch

from shoal.attention.fp8_rows import BlockScaledRows
from shoal.attention.ops.mla_sparse import SparseRows
from shoal.attention.ops.v4_decode_attention import PagedKeys
from shoal.attention.ops.v4_index_scores import v4_index_scores

SCORE_ELEMENTS = 1 << 26  # float32 scores [rows, positions] held at once: 256 MiB


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
    positions of each row, best first, with the rows' requests and counts. Needs tables of
    more than topk positions."""
    table_rows, seen = query_rows(md)
    t = q.shape[0]
    width = md.block_tables.shape[1] * md.block_size
    if width <= topk:
        raise ValueError(f"tables of {width} positions need no selection (index_topk {topk})")
    picks = torch.empty(t, topk, dtype=torch.int32, device=q.device)
    chunk = max(1, SCORE_ELEMENTS // width)
    for a in range(0, t, chunk):
        b = min(a + chunk, t)
        tables = (md.block_tables[a:b] if not md.num_prefills
                  else md.block_tables.index_select(0, table_rows[a:b]))
        keys = PagedKeys(pages, tables, fp8)
        scores = v4_index_scores(q[a:b], weights[a:b], seen[a:b] - 1, keys, 0, 1,
                                 md.block_size, scale)
        picks[a:b] = scores.topk(topk, dim=-1).indices
    return SparseRows(picks, seen, table_rows)

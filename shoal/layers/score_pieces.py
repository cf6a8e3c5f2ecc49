"""Pieces of query rows whose lightning-indexer scores are made and cut to their top-k at once
(DeepSeek-V3.2's shoal/layers/sparse_picks.py, V4's CompressedIndexer.pick_rows), so that a
long prefill chunk over a long context never holds every row's scores.

A piece of r rows over tables of c columns holds r x e float32 scores (e = c bs / ratio
entries) and torch.topk's outputs, r x top-k float32 values and int64 indices (12 bytes a
pick: three scores' worth); r x (e + 3 top-k) stays within the budget.

fixed_pieces follows the shapes alone (the rows and the tables' width): what a CUDA graph
captures. An eager step knows its rows' lengths on the host (RowRun: one request's rows,
consecutive), and cut_pieces cuts each piece's tables to the columns its rows reach, so a short
prompt beside a 128k-token one is not scored over 128k entries. The cut columns hold only
entries past every row of the piece, which score -inf: each row's visible picks (the ones that
lead, the only ones read) are the same either way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RowRun:
    """`rows` consecutive query rows of one request, the first seeing `first_seen` tokens (its
    position + 1), each next one token more."""

    rows: int
    first_seen: int


@dataclass(frozen=True)
class ScorePiece:
    """Rows [start, stop), scored over their tables' first `columns` columns."""

    start: int
    stop: int
    columns: int


def capturing(device: torch.device) -> bool:
    """Whether the work on `device` is being captured into a CUDA graph (shapes only then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check(columns: int, block_size: int, ratio: int, topk: int, budget: int) -> None:
    for name, v in (("columns", columns), ("block_size", block_size), ("ratio", ratio),
                    ("topk", topk), ("budget", budget)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def fixed_pieces(rows: int, columns: int, block_size: int, ratio: int, topk: int,
                 budget: int) -> list[ScorePiece]:
    """rows over every column of tables `columns` wide, in pieces of as many rows as the
    budget holds (at least one)."""
    _check(columns, block_size, ratio, topk, budget)
    per = max(1, budget // (columns * block_size // ratio + 3 * topk))
    return [ScorePiece(a, min(a + per, rows), columns) for a in range(0, rows, per)]


def cut_pieces(runs: Sequence[RowRun], rows: int, columns: int, block_size: int, ratio: int,
               topk: int, budget: int) -> list[ScorePiece]:
    """The runs' rows (`rows` in all, in order) in pieces, each over the columns its rows
    reach (at least top-k entries' worth, at most `columns`) and within the budget. A piece
    grows while its width stays within twice its first row's (a short prompt does not join a
    long one's piece: it would be scored at that width), so a step makes at most
    log2(columns) + 1 pieces more than the budget alone would."""
    _check(columns, block_size, ratio, topk, budget)
    if sum(r.rows for r in runs) != rows or any(r.rows < 0 or r.first_seen < 0 for r in runs):
        raise ValueError(f"row runs must count {rows} rows, none negative, got "
                         f"{[(r.rows, r.first_seen) for r in runs]}")
    least = min(columns, -(-topk * ratio // block_size))  # (top-k needs top-k entries)

    def reach(seen: int) -> int:  # the columns a row seeing `seen` tokens reads
        return min(columns, max(least, -(-seen // block_size)))

    def joins(k: int, seen: int, held: int, width: int, limit: int) -> bool:
        """Whether k rows, the first seeing `seen` tokens, join a piece of `held` rows."""
        c = max(width, reach(seen + k - 1))
        return c <= limit and (held + k) * (c * block_size // ratio + 3 * topk) <= budget

    pieces: list[ScorePiece] = []
    start = row = 0  # the open piece: rows [start, row)
    base = width = 0  # its first row's columns and its widest row's
    for run in runs:
        done = 0
        while done < run.rows:
            seen, left = run.first_seen + done, run.rows - done
            if row == start:
                base = reach(seen)
            args = (seen, row - start, width, 2 * base)
            if joins(left, *args):
                k = left
            else:  # the most rows that join: joins holds up to some k, then not
                lo, hi = 0, left - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if joins(mid, *args) else (lo, mid - 1)
                if not lo and row > start:  # (none: the piece is closed, the rows go on)
                    pieces.append(ScorePiece(start, row, width))
                    start, width = row, 0
                    continue
                k = max(lo, 1)  # (a piece holds a row at least)
            width = max(width, reach(seen + k - 1))
            row, done = row + k, done + k
            if done < run.rows:  # (full: the run goes on in a new piece)
                pieces.append(ScorePiece(start, row, width))
                start, width = row, 0
    if row > start:
        pieces.append(ScorePiece(start, row, width))
    return pieces


def top_k_in_pieces(pieces: Sequence[ScorePiece], q: torch.Tensor, weights: torch.Tensor,
                    positions: torch.Tensor, entries: Any, table_rows: torch.Tensor | None,
                    key_column: int, ratio: int, block_size: int, scale: float, topk: int
                    ) -> torch.Tensor:
    """Each row's top-k entries [R, topk] int32, best first, scored piece by piece by
    shoal/attention/ops/v4_index_scores.py: q [R, H, D], weights [R, H] at positions [R],
    entries (PagedKeys) with tables [R, N] row for row, or any rows with table_rows [R]
    saying each row's (read in the kernel: no table copied)."""
    from shoal.attention.ops.v4_index_scores import v4_index_scores
    from shoal.attention.ops.v4_paged_keys import PagedKeys

    out = torch.empty(q.shape[0], topk, dtype=torch.int32, device=q.device)
    for piece in pieces:
        a, b = piece.start, piece.stop
        tables, rows = entries.tables[:, :piece.columns], None
        if table_rows is None:
            tables = tables[a:b]
        else:
            rows = table_rows[a:b]
        scores = v4_index_scores(q[a:b], weights[a:b], positions[a:b],
                                 PagedKeys(entries.pages, tables, entries.fp8), key_column,
                                 ratio, block_size, scale, table_rows=rows)
        out[a:b] = scores.topk(topk, dim=-1).indices
    return out

"""A paged cache of one row per token that a layer reads back per request, in sliding tables
(DeepSeek-V4: the window's shared key/value rows, SlidingSharedKVSpec, and the compressors'
inputs of the groups still pooling, CompressorStateSpec). It declares its cache spec like any
paged layer; the runner binds `kv_cache` [1, num_slots, 1, width] and `kv_group`. A step
writes its rows before any request reads, so a request may read blocks another request of
the same step fills (prefix hits on blocks computed in this very step). The step's decodes
read their windows as one batch (read_decodes), from device tensors only; a step of decodes
alone writes with masked_put, since a CUDA graph's padding rows (slot -1) write nothing."""

from __future__ import annotations

import torch
from torch import nn

from shoal.core.kv_cache_spec import KVCacheSpec, SlidingSharedKVSpec, SlidingWindowSpec
from shoal.layers.request_spans import RequestSpan, StepSpans


class PagedRows(nn.Module):
    num_kv_heads = 1
    fuses_rope = False

    def __init__(self, width: int, sliding_window: int | None,
                 spec: type[SlidingWindowSpec] = SlidingSharedKVSpec):
        """Only the last sliding_window tokens are read (their tables drop the blocks behind
        it; None: a subclass keeping more declares its own spec); `spec`: the kind of rows."""
        super().__init__()
        self.width = self.head_dim = width
        self.sliding_window = sliding_window
        self.spec = spec
        self.kv_cache: torch.Tensor | None = None
        self.kv_group = 0
        self.backend = None  # bound by the runner, never used: rows need no kernel

    def kv_cache_spec(self, dtype_bytes: int) -> KVCacheSpec:
        assert self.sliding_window is not None
        return self.spec(1, self.width, dtype_bytes, self.sliding_window)

    def _rows(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("KV cache is not bound to the paged rows")
        return self.kv_cache[0].view(-1, self.width)

    def write(self, rows: torch.Tensor, step: StepSpans) -> None:
        """rows [T, width]: the step's rows, each at its token's slot (nothing for a pooling
        step; nothing for a padding row of a decode graph, slot -1)."""
        if not step.slots:
            return
        cache, slots = self._rows(), step.slots[self.kv_group]
        if step.decodes_only:
            masked_put(cache, (slots,), rows, slots >= 0)
        else:
            cache.index_copy_(0, slots, rows.to(cache.dtype))

    def read(self, rows: torch.Tensor, step: StepSpans, span: RequestSpan, lo: int,
             hi: int) -> torch.Tensor:
        """The request's rows of positions [lo, hi) (hi <= span.end): from this step's own
        `rows` when they all are new, else through its block table."""
        if lo >= span.context:
            first = span.start - span.context
            return rows[first + lo:first + hi]
        table = span.tables[self.kv_group]
        if table is None:
            raise RuntimeError("a request with cached tokens has no block table")
        bs = step.block_size
        b0, b1 = lo // bs, -(-hi // bs)
        blocks = self._rows().view(-1, bs, self.width)[table[b0:b1]].reshape(-1, self.width)
        return blocks[lo - b0 * bs:hi - b0 * bs].to(rows.dtype)

    def read_decodes(self, step: StepSpans, window: int, rows: slice
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's decodes `rows` (of [0, step.num_decodes)): each one's rows of positions
        (p - window, p] [n, window, width] from the cache (the step's own row is written
        before), and which of those positions exist [n, window] (>= 0; the others read
        position 0's row, finite). A position past the table (a graph's padding row, or a
        drafter's row after its last step: never read) reads the table's last column."""
        key = ("window", self.kv_group, window)
        if key not in step.indices:
            p = step.decode_positions
            k = p[:, None] - (window - 1) + torch.arange(window, device=p.device)
            exists = k >= 0
            k = k.clamp(min=0)
            bs = step.block_size
            table = step.decode_tables[self.kv_group]
            column = (k // bs).clamp(max=table.shape[1] - 1)
            step.indices[key] = table.gather(1, column) * bs + k % bs, exists
        slots, exists = step.indices[key]
        return self._rows()[slots[rows]], exists[rows]

    def rows_at(self, slots: torch.Tensor) -> torch.Tensor:
        """The cached rows at `slots` (any shape) [..., width]."""
        return self._rows()[slots]

    def decode_pages(self, step: StepSpans) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the decode kernels read (shoal/attention/ops/v4_decode_attention.py): the cache
        as rows [blocks, block_size, width] and the step's decodes' tables [Bd, N]."""
        bs = step.block_size
        return self._rows().view(-1, bs, self.width), step.decode_tables[self.kv_group]


def masked_put(dest: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor,
               keep: torch.Tensor) -> None:
    """dest[index][i] = values[i] for the rows where keep [n] is True; the others change
    nothing. Fixed shapes and no host read (a CUDA graph's step): a row not kept repeats a
    kept row's write (same place, same value), or, when none is kept, writes back what
    dest[0, ...] holds. Its index may be anything (-1, out of range): it is never used."""
    any_kept = keep.any()
    first = keep.to(torch.int32).argmax().view(1)  # a kept row (0 when none is)

    def redirected(i: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, i, torch.where(any_kept, i.index_select(0, first), 0))

    at = tuple(redirected(i) for i in index)
    src = values.to(dest.dtype)
    other = torch.where(any_kept, src.index_select(0, first), dest[at])
    keep_rows = keep.view(-1, *(1,) * (src.dim() - 1))
    dest.index_put_(at, torch.where(keep_rows, src, other))

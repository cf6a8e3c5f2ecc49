"""A paged cache of one row per token that a layer reads back per request, in sliding tables
(DeepSeek-V4: the window's shared key/value rows, SlidingSharedKVSpec, and the compressors'
inputs of the groups still pooling, CompressorStateSpec). It declares its cache spec like any
paged layer; the runner binds `kv_cache` [1, num_slots, 1, width] and `kv_group`. A step
writes its rows before any request reads, so a request may read blocks another request of
the same step fills (prefix hits on blocks computed in this very step). The step's decodes
read their windows as one batch (read_decodes), from device tensors only; a step of decodes
alone writes with masked_put, since a CUDA graph's padding rows (slot -1) write nothing.

In an FP8 pool (kv_cache_dtype="fp8") rows with an FP8 layout (`fp8`, attention/fp8_rows.py)
are stored as e4m3 bytes with a float32 scale per block of values, and read back dequantized
(write returns the step's rows as later reads give them, so a request reading its own new
rows sees what a prefix hit on them would; a caller that reads them from the cache asks for
none); rows without one keep their `dtype` (the
model's), stored as its bytes: the spec counts a row's width in the pool's one-byte elements
either way."""

from __future__ import annotations

import torch
from torch import nn

from shoal.attention import kv_quant
from shoal.attention.fp8_rows import BlockScaledRows
from shoal.core.kv_cache_spec import KVCacheSpec, SlidingSharedKVSpec, SlidingWindowSpec
from shoal.layers.request_spans import RequestSpan, StepSpans
from shoal.layers.span_rows import span_tables


class PagedRows(nn.Module):
    num_kv_heads = 1
    fuses_rope = False

    def __init__(self, width: int, sliding_window: int | None,
                 spec: type[SlidingWindowSpec] = SlidingSharedKVSpec, *,
                 fp8: BlockScaledRows | None = None, dtype: torch.dtype | None = None):
        """Only the last sliding_window tokens are read (their tables drop the blocks behind
        it; None: a subclass keeping more declares its own spec); `spec`: the kind of rows;
        fp8: the rows' layout in an FP8 pool, or None: there they keep `dtype`."""
        super().__init__()
        if fp8 is not None and fp8.width != width:
            raise ValueError(f"an FP8 layout of {fp8.width} values for rows of {width}")
        self.width = self.head_dim = width
        self.sliding_window = sliding_window
        self.spec = spec
        self.fp8_rows = fp8
        self.row_dtype = dtype
        self.kv_cache: torch.Tensor | None = None
        self.kv_group = 0
        self.backend = None  # bound by the runner, never used: rows need no kernel

    def stored_width(self, dtype_bytes: int) -> int:
        """A row's width in elements of a pool of dtype_bytes each (FP8: bytes)."""
        if dtype_bytes != kv_quant.FP8_KV_DTYPE.itemsize:
            return self.width
        if self.fp8_rows is not None:
            return self.fp8_rows.row_bytes
        if self.row_dtype is None:
            raise ValueError("paged rows with neither an FP8 layout nor a dtype of their own "
                             "cannot be kept in an FP8 KV cache")
        return self.width * self.row_dtype.itemsize

    def kv_cache_spec(self, dtype_bytes: int) -> KVCacheSpec:
        assert self.sliding_window is not None
        return self.spec(1, self.stored_width(dtype_bytes), dtype_bytes, self.sliding_window)

    @property
    def quantized(self) -> bool:
        """Whether the rows are stored as block-scaled FP8 (an FP8 pool, an FP8 layout)."""
        return (self.fp8_rows is not None and self.kv_cache is not None
                and kv_quant.is_fp8(self.kv_cache))

    @property
    def row_width(self) -> int:
        """A row's stored width in the storage's elements (FP8 rows: bytes)."""
        layout = self.fp8_rows
        return layout.row_bytes if layout is not None and self.quantized else self.width

    def _storage(self) -> torch.Tensor:
        """The cache [num_slots, 1, stored width] as stored: FP8 rows as bytes (uint8), rows
        kept in their dtype in an FP8 pool as that dtype."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache is not bound to the paged rows")
        cache = self.kv_cache[0]
        if not kv_quant.is_fp8(cache):
            return cache
        return cache.view(torch.uint8 if self.fp8_rows is not None else self.row_dtype)

    def _rows(self) -> torch.Tensor:
        """The stored rows [num_slots, stored width]."""
        cache = self._storage()
        return cache.view(-1, cache.shape[-1])

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., width] as stored."""
        if self.quantized:
            assert self.fp8_rows is not None
            return self.fp8_rows.quantize(rows)
        return rows.to(self._storage().dtype)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype | None,
               columns: slice = slice(None)) -> torch.Tensor:
        """Stored rows [..., stored width] -> the values of `columns` in dtype (None: as
        stored; not for FP8 rows)."""
        if self.quantized:
            assert self.fp8_rows is not None
            if dtype is None:
                raise ValueError("FP8 rows are read back in a dtype")
            return self.fp8_rows.dequantize(stored, dtype, columns)
        stored = stored[..., columns]
        return stored if dtype is None else stored.to(dtype)

    def write(self, rows: torch.Tensor, step: StepSpans, *,
              want_rows: bool = True) -> torch.Tensor | None:
        """rows [T, width]: the step's rows, each at its token's slot (nothing for a pooling
        step; nothing for a padding row of a decode graph, slot -1). Returns them as a later
        read gives them (FP8: rounded); None where want_rows is False (a caller reading its
        rows from the cache: no FP8 rows dequantized for nothing)."""
        if not step.slots:  # (a pooling step: no cache bound, nothing to round)
            return rows if want_rows else None
        stored = self.encode(rows)
        cache, slots = self._rows(), step.slots[self.kv_group]
        if step.decodes_only:
            masked_put(cache, (slots,), stored, slots >= 0)
        else:
            cache.index_copy_(0, slots, stored)
        return self.decode(stored, rows.dtype) if want_rows else None

    def read(self, rows: torch.Tensor, step: StepSpans, span: RequestSpan, lo: int,
             hi: int) -> torch.Tensor:
        """The request's rows of positions [lo, hi) (hi <= span.end): from this step's own
        `rows` (as write returned them) when they all are new, else through its block
        table, in rows' dtype."""
        if lo >= span.context:
            first = span.start - span.context
            return rows[first + lo:first + hi]
        table = span.tables[self.kv_group]
        if table is None:
            raise RuntimeError("a request with cached tokens has no block table")
        bs = step.block_size
        b0, b1 = lo // bs, -(-hi // bs)
        stored = self._rows()
        width = stored.shape[-1]
        blocks = stored.view(-1, bs, width)[table[b0:b1]].reshape(-1, width)
        return self.decode(blocks[lo - b0 * bs:hi - b0 * bs], rows.dtype)

    def read_decodes(self, step: StepSpans, window: int, rows: slice,
                     dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's decodes `rows` (of [0, step.num_decodes)): each one's rows of positions
        (p - window, p] [n, window, width] from the cache (the step's own row is written
        before), in dtype (None: as stored), and which of those positions exist [n, window]
        (>= 0; the others read position 0's row, finite). A position past the table (a
        graph's padding row, or a drafter's row after its last step: never read) reads the
        table's last column."""
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
        return self.decode(self._rows()[slots[rows]], dtype), exists[rows]

    def rows_at(self, slots: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The cached rows at `slots` (any shape) [..., width], in dtype (None: as stored)."""
        return self.decode(self._rows()[slots], dtype)

    def decode_pages(self, step: StepSpans
                     ) -> tuple[torch.Tensor, torch.Tensor, BlockScaledRows | None] | None:
        """What the row kernels read for the step's decodes (PagedKeys of
        shoal/attention/ops/v4_decode_attention.py): kernel_pages with their tables [Bd, N]."""
        return self.kernel_pages(step, step.decode_tables[self.kv_group])

    def span_pages(self, step: StepSpans
                   ) -> tuple[torch.Tensor, torch.Tensor, BlockScaledRows | None] | None:
        """What the row kernels read for the step's prefill chunks and verify steps:
        kernel_pages with each span's table [P, N] (shoal/layers/span_rows.py)."""
        return self.kernel_pages(step, span_tables(step, self.kv_group))

    def kernel_pages(self, step: StepSpans, tables: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, BlockScaledRows | None] | None:
        """The cache as stored rows [blocks, block_size, stored width], `tables`, and the
        rows' FP8 layout (None: stored as values)."""
        bs = step.block_size
        stored = self._rows()
        return (stored.view(-1, bs, stored.shape[-1]), tables,
                self.fp8_rows if self.quantized else None)


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

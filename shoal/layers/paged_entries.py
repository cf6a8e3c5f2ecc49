"""DeepSeek-V4's compressed entries in their paged cache (CompressedEntrySpec): one row of
`width` values per complete group of `ratio` tokens, in the full-attention tables.

Entry w is stored once, by the step computing its group's last token e = (w + 1) ratio - 1,
in slot w - floor(k bs / ratio) of block k = e // bs: the block holding e, so a block's page
depends only on the tokens up to its end and prefix caching shares it as it shares keys. The
page is the block's token slots of slot_row values each, read as ceil(bs / ratio) entries.
Like PagedRows (which it extends for the runner's binding), a step stores every request's
new entries before any request loads, so a prefix hit on blocks computed in the same step
reads them. The step's decodes store and load theirs as one batch, in shapes fixed by their
tables' width (N blocks hold at most N bs / ratio entries; each decode masks those past its
own), from device tensors only: a CUDA graph replays them. In an FP8 pool an entry is
stored as PagedRows stores its FP8 rows (attention/fp8_rows.py: e4m3 bytes and a scale per
block; `width` then counts them in the page's one-byte elements)."""

from __future__ import annotations

import torch

from shoal.attention.fp8_rows import BlockScaledRows
from shoal.core.kv_cache_spec import CompressedEntrySpec
from shoal.layers.paged_rows import PagedRows, masked_put
from shoal.layers.request_spans import RequestSpan, StepSpans


class PagedEntries(PagedRows):
    def __init__(self, width: int, ratio: int, *, fp8: BlockScaledRows | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__(width, None, fp8=fp8, dtype=dtype)  # every entry of the context is kept
        self.ratio = ratio

    def kv_cache_spec(self, dtype_bytes: int) -> CompressedEntrySpec:
        return CompressedEntrySpec(1, self.stored_width(dtype_bytes), dtype_bytes,
                                   ratio=self.ratio)

    def _pages(self, bs: int) -> torch.Tensor:
        """[blocks, entries per block, stored width]: the cache as entry slots."""
        cache = self._storage()
        per_block = -(-bs // self.ratio)
        pages = cache.view(-1, bs * cache.shape[-1])
        width = self.row_width
        return pages[:, :per_block * width].unflatten(1, (per_block, width))

    def _at(self, bs: int, blocks: torch.Tensor, slot: torch.Tensor, columns: slice,
            dtype: torch.dtype | None) -> torch.Tensor:
        """The `columns` of the entries at (blocks, slot), in dtype (None: as stored)."""
        pages = self._pages(bs)
        if self.quantized:  # (the whole stored rows: their scales follow the values)
            return self.decode(pages[blocks, slot], dtype, columns)
        return self.decode(pages[..., columns][blocks, slot], dtype)

    def _slots(self, first: int, n: int, bs: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries [first, first + n): each one's last token, and its slot in that token's
        block."""
        w = torch.arange(first, first + n, device=device)
        last = (w + 1) * self.ratio - 1
        return last, w - torch.div(last, bs, rounding_mode="floor") * bs // self.ratio

    def store(self, entries: torch.Tensor, first: int, step: StepSpans, span: RequestSpan, *,
              want_rows: bool = True) -> torch.Tensor | None:
        """entries [n, width]: the request's entries [first, first + n), whose groups close
        in this step (nothing for a pooling step, which caches nothing). Returns them as a
        later load gives them (FP8: rounded); None where want_rows is False (a caller reading
        them from the cache)."""
        if not step.slots:  # (a pooling step: no cache bound, nothing to round)
            return entries if want_rows else None
        stored = self.encode(entries)
        if len(entries):
            bs, slots = step.block_size, step.slots[self.kv_group]
            last, slot = self._slots(first, len(entries), bs, slots.device)
            blocks = torch.div(slots[span.start + last - span.context], bs,
                               rounding_mode="floor")
            self._pages(bs)[blocks, slot] = stored
        return self.decode(stored, entries.dtype) if want_rows else None

    def store_decodes(self, entries: torch.Tensor, keep: torch.Tensor,
                      groups: torch.Tensor, step: StepSpans) -> None:
        """entries [Bd, width]: for each of the step's decodes the entry of group groups[b],
        stored where keep [Bd] says the decode's token closes that group (the others, and a
        graph's padding rows, store nothing)."""
        bs, nd = step.block_size, step.num_decodes
        token_slots = step.slots[self.kv_group][:nd]
        blocks = torch.div(token_slots, bs, rounding_mode="floor")
        last = step.decode_positions
        slot = groups - torch.div(last, bs, rounding_mode="floor") * bs // self.ratio
        masked_put(self._pages(bs), (blocks, slot), self.encode(entries), keep)

    def load(self, step: StepSpans, span: RequestSpan, n: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """The request's first n entries [n, width], through its block table, in dtype
        (None: as stored)."""
        table = span.tables[self.kv_group]
        if table is None:
            raise RuntimeError("a request with cached tokens has no block table")
        bs = step.block_size
        last, slot = self._slots(0, n, bs, table.device)
        blocks = table[torch.div(last, bs, rounding_mode="floor")]
        return self._at(bs, blocks, slot, slice(None), dtype)

    def decode_index(self, step: StepSpans
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where the step's decodes' entries lie: blocks [Bd, n], slots [n] and which are
        each decode's own [Bd, n] (complete groups; the step's own are stored before), n =
        what its tables' width holds (None: not one entry). Built once per step."""
        key = ("entries", self.kv_group, self.ratio)
        if key not in step.indices:
            m, bs = self.ratio, step.block_size
            table = step.decode_tables[self.kv_group]
            n_max = table.shape[1] * bs // m
            index = None
            if n_max:
                p = step.decode_positions
                last, slot = self._slots(0, n_max, bs, p.device)
                # a decode's padding entries (past its own) read a block of its table or the
                # table's padding: finite, masked
                column = torch.div(last, bs, rounding_mode="floor")
                seen = torch.div(p + 1, m, rounding_mode="floor")
                own = torch.arange(n_max, device=p.device) < seen[:, None]
                index = table[:, column], slot, own
            step.indices[key] = index
        return step.indices[key]

    def kernel_pages(self, step: StepSpans, tables: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, BlockScaledRows | None] | None:
        """What the row kernels read (shoal/attention/ops/v4_decode_attention.py PagedKeys;
        decode_pages, span_pages): the cache as entry slots [blocks, ceil(bs / ratio), stored
        width], `tables` and the entries' FP8 layout (None: stored as values); None: the
        tables hold no entry."""
        if not tables.shape[1] * step.block_size // self.ratio:
            return None
        return (self._pages(step.block_size), tables,
                self.fp8_rows if self.quantized else None)

    def load_decodes(self, step: StepSpans, rows: slice, columns: slice = slice(None),
                     dtype: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's decodes `rows` (of [0, step.num_decodes)): the `columns` of every
        entry their tables hold [n, N, w] in dtype (None: as stored) and which are each
        one's own [n, N] (None: the tables hold no entry)."""
        index = self.decode_index(step)
        if index is None:
            return None
        blocks, slot, own = index
        return self._at(step.block_size, blocks[rows], slot, columns, dtype), own[rows]

    def gather_decodes(self, step: StepSpans, rows: slice, picked: torch.Tensor,
                       columns: slice = slice(None), dtype: torch.dtype | None = None
                       ) -> torch.Tensor:
        """The `columns` of the entries picked [n, k] (indices of decode_index's n entries)
        by each of the step's decodes `rows` [n, k, w], in dtype (None: as stored)."""
        blocks, slot, _ = self.decode_index(step)
        return self._at(step.block_size, blocks[rows].gather(1, picked), slot[picked],
                        columns, dtype)

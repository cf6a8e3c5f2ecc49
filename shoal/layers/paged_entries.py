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
own), from device tensors only: a CUDA graph replays them."""

from __future__ import annotations

import torch

from shoal.core.kv_cache_spec import CompressedEntrySpec
from shoal.layers.paged_rows import PagedRows, masked_put
from shoal.layers.request_spans import RequestSpan, StepSpans


class PagedEntries(PagedRows):
    def __init__(self, width: int, ratio: int):
        super().__init__(width, None)  # every entry of the context is kept
        self.ratio = ratio

    def kv_cache_spec(self, dtype_bytes: int) -> CompressedEntrySpec:
        return CompressedEntrySpec(1, self.width, dtype_bytes, ratio=self.ratio)

    def _pages(self, bs: int) -> torch.Tensor:
        """[blocks, entries per block, width]: the cache as entry slots."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache is not bound to the paged entries")
        per_block = -(-bs // self.ratio)
        pages = self.kv_cache[0].view(-1, bs * self.kv_cache.shape[-1])
        return pages[:, :per_block * self.width].unflatten(1, (per_block, self.width))

    def _slots(self, first: int, n: int, bs: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries [first, first + n): each one's last token, and its slot in that token's
        block."""
        w = torch.arange(first, first + n, device=device)
        last = (w + 1) * self.ratio - 1
        return last, w - torch.div(last, bs, rounding_mode="floor") * bs // self.ratio

    def store(self, entries: torch.Tensor, first: int, step: StepSpans,
              span: RequestSpan) -> None:
        """entries [n, width]: the request's entries [first, first + n), whose groups close
        in this step (nothing for a pooling step, which caches nothing)."""
        if not step.slots or not len(entries):
            return
        bs, slots = step.block_size, step.slots[self.kv_group]
        last, slot = self._slots(first, len(entries), bs, slots.device)
        blocks = torch.div(slots[span.start + last - span.context], bs, rounding_mode="floor")
        pages = self._pages(bs)
        pages[blocks, slot] = entries.to(pages.dtype)

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
        masked_put(self._pages(bs), (blocks, slot), entries, keep)

    def load(self, step: StepSpans, span: RequestSpan, n: int) -> torch.Tensor:
        """The request's first n entries [n, width], through its block table."""
        table = span.tables[self.kv_group]
        if table is None:
            raise RuntimeError("a request with cached tokens has no block table")
        bs = step.block_size
        last, slot = self._slots(0, n, bs, table.device)
        blocks = table[torch.div(last, bs, rounding_mode="floor")]
        return self._pages(bs)[blocks, slot]

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

    def decode_pages(self, step: StepSpans) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the decode kernels read (shoal/attention/ops/v4_decode_attention.py): the cache
        as entry slots [blocks, ceil(bs / ratio), width] and the step's decodes' tables [Bd,
        N] (None: the tables hold no entry)."""
        table = step.decode_tables[self.kv_group]
        if not table.shape[1] * step.block_size // self.ratio:
            return None
        return self._pages(step.block_size), table

    def load_decodes(self, step: StepSpans, rows: slice, columns: slice = slice(None)
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's decodes `rows` (of [0, step.num_decodes)): the `columns` of every
        entry their tables hold [n, N, w] and which are each one's own [n, N] (None: the
        tables hold no entry)."""
        index = self.decode_index(step)
        if index is None:
            return None
        blocks, slot, own = index
        return self._pages(step.block_size)[..., columns][blocks[rows], slot], own[rows]

    def gather_decodes(self, step: StepSpans, rows: slice, picked: torch.Tensor,
                       columns: slice = slice(None)) -> torch.Tensor:
        """The `columns` of the entries picked [n, k] (indices of decode_index's n entries)
        by each of the step's decodes `rows` [n, k, w]."""
        blocks, slot, _ = self.decode_index(step)
        pages = self._pages(step.block_size)[..., columns]
        return pages[blocks[rows].gather(1, picked), slot[picked]]

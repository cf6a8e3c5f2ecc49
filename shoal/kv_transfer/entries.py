"""DeepSeek-V4's compressed entries as transferred bytes (CompressedEntrySpec: one entry per
complete group of `ratio` tokens, CSA's with its indexer key beside it).

An entry is not a token's row: entry w (pooling tokens [w ratio, (w + 1) ratio)) sits in the
block holding its group's last token e = (w + 1) ratio - 1, at entry slot w - floor(k bs /
ratio) of block k = e // bs, the page being the block's token slots read as ceil(bs / ratio)
entries (shoal/layers/paged_entries.py). Where an entry lands thus depends on the block size,
and a page's width (slot_row) too, so what moves is the entries themselves, in entry order:
[1, n, 1, entry bytes]; each side finds them in, or puts them into, its own blocks by index.
With groups longer than a block (HCA) only the blocks closing a group are in the table, and
only those are read or written here."""

from __future__ import annotations

import torch

from shoal.core.kv_cache_spec import CompressedEntrySpec


def entry_bytes(spec: CompressedEntrySpec) -> int:
    return spec.head_size * spec.dtype_bytes


def _entry_slots(kv: torch.Tensor, spec: CompressedEntrySpec, block_size: int) -> torch.Tensor:
    """The layer's cache as [pages, entries per block, entry bytes] uint8 (a view)."""
    per_block, width = spec.entries_per_block(block_size), entry_bytes(spec)
    page = block_size * kv.shape[2] * kv.shape[3] * kv.element_size()
    if kv.shape[0] != 1 or per_block * width > page:
        raise ValueError(f"a cache of shape {list(kv.shape)} holds no {per_block} entries of "
                         f"{width} bytes a block of {block_size}")
    pages = kv.view(torch.uint8).view(-1, page)
    return pages[:, :per_block * width].unflatten(1, (per_block, width))


def _where(table: list[int], spec: CompressedEntrySpec, block_size: int, first: int, end: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The page and entry slot of entries [first, end) in a request's table."""
    w = torch.arange(first, end)
    k = torch.div((w + 1) * spec.ratio - 1, block_size, rounding_mode="floor")
    if len(k) and int(k[-1]) >= len(table):
        raise ValueError(f"entry {end - 1} of ratio {spec.ratio} lies in block {int(k[-1])}, "
                         f"but the request's table holds {len(table)} blocks")
    pages = torch.tensor(table, dtype=torch.long)[k]
    return pages.to(device), (w - k * block_size // spec.ratio).to(device)


def read_entries(kv: torch.Tensor, spec: CompressedEntrySpec, table: list[int],
                 block_size: int, num_tokens: int) -> torch.Tensor:
    """The entries of every complete group of tokens [0, num_tokens) [1, n, 1, entry bytes]
    uint8 (a copy, on the cache's device)."""
    n = num_tokens // spec.ratio
    pages, slots = _where(table, spec, block_size, 0, n, kv.device)
    return _entry_slots(kv, spec, block_size)[pages, slots].view(1, n, 1, entry_bytes(spec))


def write_entries(kv: torch.Tensor, spec: CompressedEntrySpec, table: list[int],
                  block_size: int, first: int, rows: torch.Tensor) -> None:
    """Writes entries [first, first + len) (rows [len, entry bytes] uint8, any device) into
    the request's blocks."""
    if not len(rows):
        return
    pages, slots = _where(table, spec, block_size, first, first + len(rows), kv.device)
    _entry_slots(kv, spec, block_size)[pages, slots] = rows.to(kv.device, non_blocking=True)

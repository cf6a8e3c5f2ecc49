"""A paged cache as DeepSeek-V4's kernels (v4_decode_attention.py, v4_index_scores.py) read
it: its pages and block tables, the operands of its keys when the pages hold block-scaled FP8
rows, the Triton load of one tile of keys, and the checks of a cache's and table rows' shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shoal.attention.fp8_rows import ROW_ALIGN, BlockScaledRows
from shoal.attention.kv_quant import FP8_KV_DTYPE
from shoal.attention.ops.fp8 import check_fp8_cache


@dataclass(frozen=True)
class PagedKeys:
    """A paged cache as the decode kernels read it: pages [num_blocks, slots a block, width]
    (any strides but the last; the keys in the first head_dim columns: a window's block holds
    block_size token rows, an entries' page ceil(block_size / ratio) entries) and each decode
    row's block table [R, N] (any integer dtype). fp8: the rows' layout when the pages hold
    block-scaled FP8 rows (as bytes: uint8 or float8; width their stored bytes; slots and
    blocks strided by multiples of 16 bytes), None when they hold the values."""

    pages: torch.Tensor
    tables: torch.Tensor
    fp8: BlockScaledRows | None = None


class KeyOperands(NamedTuple):
    """What a kernel reads for keys at one column of a PagedKeys: the pages (FP8 pages as
    float8), their float32 scale words (the pages again when not FP8: never read), the first
    scale's word in a row and the values a scale covers."""

    values: torch.Tensor
    scales: torch.Tensor
    first_scale: int
    block: int
    fp8: bool


def key_operands(name: str, paged: PagedKeys, column: int, dim: int,
                 q_dtype: torch.dtype) -> KeyOperands:
    """The operands of keys [column, column + dim) of `paged`; ValueError where FP8 pages
    cannot be read (their layout, this GPU, misaligned rows).

    FP8 rows must start 16-byte aligned (strides of multiples of 16 bytes; the pages' own
    start Triton checks at each launch): Triton may load a row's values in 16-byte vectors,
    and rows only 4-byte aligned faulted on an H100 ("misaligned address"). Every layout of
    attention/fp8_rows.py pads its rows to a multiple of 16 bytes; this refuses any other."""
    pages = paged.pages
    if paged.fp8 is None:
        if pages.dtype in (FP8_KV_DTYPE, torch.uint8):
            raise ValueError(f"{name} pages hold FP8 bytes: pass their rows' layout (fp8)")
        return KeyOperands(pages, pages, 0, 1, False)
    if pages.dtype not in (FP8_KV_DTYPE, torch.uint8) or pages.shape[-1] != paged.fp8.row_bytes:
        raise ValueError(f"{name} FP8 pages must be bytes of rows of {paged.fp8.row_bytes}, got "
                         f"{pages.dtype} of {pages.shape[-1]}")
    if any(s % ROW_ALIGN for s in pages.stride()[:-1]):
        raise ValueError(f"{name} FP8 pages' slots and blocks must be strided by multiples of "
                         f"{ROW_ALIGN} bytes (the GPU loads rows in {ROW_ALIGN}-byte vectors), "
                         f"got strides {pages.stride()}")
    first, block = paged.fp8.scales_of(column, dim)
    values = pages.view(FP8_KV_DTYPE)
    check_fp8_cache(values, q_dtype)
    try:
        scales = pages.view(torch.float32)
    except RuntimeError as e:
        raise ValueError(f"{name} FP8 pages must start 4-byte aligned in their storage (for "
                         f"their float32 scales): {e}") from e
    return KeyOperands(values, scales, first, block, True)


@triton.jit
def load_keys(ptr, sc_ptr, block, slot, stride_b, stride_s, stride_sb, stride_ss, sc0, d,
              valid, QBLOCK: tl.constexpr, KV_FP8: tl.constexpr):
    """The keys [BLOCK_N, D] in slot `slot` of page `block` each (int64), as stored (strides
    in the pages' elements); FP8 rows in float32, times the scale of each value's block
    (stride_sb, stride_ss: the pages' strides in float32 words, sc0 a row's first scale)."""
    k = tl.load(ptr + (block * stride_b + slot * stride_s)[:, None] + d[None, :],
                mask=valid[:, None], other=0.0)
    if KV_FP8:
        sc = block * stride_sb + slot * stride_ss + sc0
        s = tl.load(sc_ptr + sc[:, None] + (d // QBLOCK)[None, :], mask=valid[:, None],
                    other=0.0)
        k = k.to(tl.float32) * s
    return k


def check_table_rows(table_rows: torch.Tensor | None, rows: int) -> None:
    """table_rows: None, or each row's row of the tables [rows] (int32/int64; its values, on
    the device, are not checked: the caller's to keep below the tables' rows)."""
    if table_rows is None:
        return
    if tuple(table_rows.shape) != (rows,) or table_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"table_rows must be int32/int64 of shape ({rows},), got "
                         f"{table_rows.dtype} {tuple(table_rows.shape)}")


def check_pages(name: str, paged: PagedKeys, rows: int, dim: int, column: int = 0) -> None:
    """A cache whose pages hold `dim` values at `column` of each slot, tables for `rows`."""
    pages, tables = paged.pages, paged.tables
    if pages.dim() != 3 or pages.stride(2) != 1 or not 0 <= column \
            or column + dim > pages.shape[2]:
        raise ValueError(f"{name} pages must be [blocks, slots, >= {column + dim}] with a "
                         f"contiguous last dim, got {tuple(pages.shape)} strides "
                         f"{pages.stride()}")
    if tables.dim() != 2 or tables.shape[0] < rows or tables.shape[1] < 1:
        raise ValueError(f"{name} tables must be [>= {rows}, >= 1], got "
                         f"{tuple(tables.shape)}")

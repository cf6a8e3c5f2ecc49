"""Rows of a paged cache stored as FP8 with a float32 scale per block of columns: how
kv_cache_dtype="fp8" keeps the DeepSeek sparse family's own caches (V3.2's indexer keys, V4's
window rows and compressed entries; their latent / MLA rows use kv_quant.py's scale per layer).

Why a scale per row block and not kv_quant.py's one per layer: no checkpoint carries scales
for these rows, and their sizes vary from token to token (LayerNorm'd indexer keys, RMSNorm'd
and rotated V4 entries), so one fixed scale would saturate some rows and flush others to
FP8's subnormals. A block's scale is its largest |value| / 448, taken when the row is
written, so nothing saturates and each block uses e4m3's whole range. DeepSeek's reference
inference of V3.2 stores its indexer keys this way (e4m3, a float32 scale per 128 values).

A row of D values in the pool's FP8 tensor (one byte an element): the values as e4m3 bytes
(padded to a multiple of 4), then the scales as float32 (native byte order), then zeros up to
a multiple of 16 bytes. It costs about D + 4 D / block bytes instead of bfloat16's 2 D, and
its scales travel with it through every page copy (KV tiers, transfers, prefix hits); a
zeroed row reads as zeros. A row may have segments of different blocks (V4's CSA entry: its
key, then the indexer's key): a block never straddles two segments, so each part can be read
alone.

Why rows of a multiple of 16 bytes: so that every row of a page starts 16-byte aligned. The
GPU kernels load a row's values in vectors of up to 16 bytes (ld.global.v4) where Triton's
analysis judges the row start aligned, and Triton 3.6 judged so wrongly for V4's CSA entries
(640 values + 9 scales = 676 bytes) in the decode kernel's every-entry mode: an H100 faulted
with "misaligned address". Aligned rows (688 bytes) are right whatever the analysis says, and
get 16-byte loads (Triton 3.9 read the 676-byte rows byte by byte). The padding costs at most
12 bytes a row (V3.2's indexer key: 132 -> 144); the kernels' operands refuse FP8 pages whose
rows or blocks are not 16-byte strided (ops/v4_paged_keys.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shoal.attention.kv_quant import FP8_KV_DTYPE, FP8_MAX

# Values a scale covers (the largest divisor of the segment's width up to this): DeepSeek's
# indexer keys use 128; V4's 512-wide rows use 64, so their last 64 channels (the rotated
# ones, of another magnitude) get scales of their own.
INDEXER_KEY_BLOCK = 128
KV_ROW_BLOCK = 64
ROW_ALIGN = 16  # bytes: a row's size is a multiple of it (the GPU's widest vector load)


@dataclass(frozen=True)
class BlockScaledRows:
    """The layout of one row: segments (width, block) in column order, each quantized in
    blocks of `block` values (block divides width)."""

    segments: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a block-scaled row needs at least one segment")
        for width, block in self.segments:
            if width < 1 or block < 1 or width % block:
                raise ValueError(f"segment width {width} must be >= 1 and a multiple of its "
                                 f"block {block}")

    @classmethod
    def of(cls, *parts: tuple[int, int]) -> BlockScaledRows:
        """parts: (width, preferred block); widths of 0 are left out; each block is the
        largest common divisor of the width and the preferred block (a power of two)."""
        return cls(tuple((w, math.gcd(w, b)) for w, b in parts if w))

    @property
    def width(self) -> int:
        return sum(w for w, _ in self.segments)

    @property
    def num_scales(self) -> int:
        return sum(w // b for w, b in self.segments)

    @property
    def values_bytes(self) -> int:
        return -(-self.width // 4) * 4  # the scales start 4-byte aligned

    @property
    def scales_end(self) -> int:
        """The byte after the last scale: the rest of the row is zero padding."""
        return self.values_bytes + 4 * self.num_scales

    @property
    def row_bytes(self) -> int:
        return -(-self.scales_end // ROW_ALIGN) * ROW_ALIGN

    def scales_of(self, column: int, width: int) -> tuple[int, int]:
        """The values [column, column + width) lying in one segment: (its first scale's
        index in the row read as float32 words, its block)."""
        start, first = 0, self.values_bytes // 4
        for w, b in self.segments:
            if start <= column and column + width <= start + w and (column - start) % b == 0:
                return first + (column - start) // b, b
            start, first = start + w, first + w // b
        raise ValueError(f"columns [{column}, {column + width}) are not whole blocks of one "
                         f"segment of {self.segments}")

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., width] -> its stored rows [..., row_bytes] (uint8)."""
        if x.shape[-1] != self.width:
            raise ValueError(f"rows of {x.shape[-1]} values, the layout has {self.width}")
        x = x.float()
        values, scales, start = [], [], 0
        for w, b in self.segments:
            part = x[..., start:start + w].unflatten(-1, (w // b, b))
            amax = part.abs().amax(-1)
            scale = amax / FP8_MAX  # (0 where a block is 0 or so tiny the division underflows)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = (part / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)
            values.append(q.flatten(-2).view(torch.uint8))
            scales.append(scale)
            start += w
        pad = self.values_bytes - self.width
        if pad:
            values.append(values[0].new_zeros(*x.shape[:-1], pad))
        words = torch.cat(scales, -1).contiguous().view(torch.uint8)
        tail = values[0].new_zeros(*x.shape[:-1], self.row_bytes - self.scales_end)
        return torch.cat([*values, words, tail], -1)

    def dequantize(self, stored: torch.Tensor, dtype: torch.dtype,
                   columns: slice = slice(None)) -> torch.Tensor:
        """Stored rows [..., row_bytes] (uint8 or FP8 bytes) -> the values of `columns`
        (whole blocks) [..., n] in dtype."""
        if stored.shape[-1] != self.row_bytes:
            raise ValueError(f"stored rows of {stored.shape[-1]} bytes, the layout's are "
                             f"{self.row_bytes}")
        stored = stored.view(torch.uint8)
        c0, c1, step = columns.indices(self.width)
        if step != 1 or c1 <= c0:
            raise ValueError(f"columns {columns} must be a non-empty contiguous slice")
        scales = stored[..., self.values_bytes:self.scales_end].contiguous().view(torch.float32)
        parts, start, first = [], 0, 0
        for w, b in self.segments:
            lo, hi = max(c0, start), min(c1, start + w)
            if lo < hi:
                if (lo - start) % b or (hi - start) % b:
                    raise ValueError(f"columns [{c0}, {c1}) cut a block of {b} values")
                n = (hi - lo) // b
                values = stored[..., lo:hi].view(FP8_KV_DTYPE).float().unflatten(-1, (n, b))
                s = scales[..., first + (lo - start) // b:][..., :n]
                parts.append((values * s[..., None]).flatten(-2))
            start, first = start + w, first + w // b
        out = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        return out.to(dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What a later read of rows x gives, in x's dtype."""
        return self.dequantize(self.quantize(x), x.dtype)

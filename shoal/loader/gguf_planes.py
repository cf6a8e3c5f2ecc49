"""Cut bit fields out of a chunk of GGML blocks with few, long torch ops (gguf_dequant's tool).

A chunk's bytes are treated as one flat string of int64 words: field s of every byte (a nibble,
a 2-bit crumb or a bit) comes out for all blocks at once as one "plane"; then one index_select
of byte runs across the planes lays the fields out in value order. Both are long contiguous
ops; the row-at-a-time alternative costs ~10 ns per 16-32 value row in torch.
"""

from __future__ import annotations

import functools

import torch

# Each byte's low `bits` bits, in all eight bytes of a word.
_FIELD_MASKS = {1: 0x0101010101010101, 2: 0x0303030303030303, 4: 0x0F0F0F0F0F0F0F0F}
_BIT_OF_EACH_BYTE = 0x8040201008040201 - (1 << 64)  # bit k of byte k (as a signed int64)

Runs = tuple[tuple[int, int], ...]  # (field index, byte offset in the block) per run


class Chunk:
    """Blocks [n, type_size] (uint8, contiguous) and their field planes, made on demand."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks
        flat = blocks.reshape(-1)
        if pad := -flat.numel() % 8:  # only a tensor's last chunk can be ragged
            flat = torch.cat([flat, flat.new_zeros(pad)])
        self._bytes = flat
        self._planes: dict[int, torch.Tensor] = {8: flat[None]}

    def planes(self, bits: int) -> torch.Tensor:
        """uint8 [8 // bits, bytes]: plane s holds bits [s * bits, (s + 1) * bits) of every
        byte, shifted down."""
        planes = self._planes.get(bits)
        if planes is None:
            words, mask = self._bytes.view(torch.int64), _FIELD_MASKS[bits]
            planes = torch.empty(8 // bits, words.numel(), dtype=torch.int64)
            torch.bitwise_and(words, mask, out=planes[0])
            for field in range(1, 8 // bits):
                torch.bitwise_right_shift(words, field * bits, out=planes[field])
            # the mask also drops what the arithmetic shift brought in from the next byte
            planes[1:].bitwise_and_(mask)
            planes = self._planes[bits] = planes.view(torch.uint8)
        return planes

    def gather(self, bits: int, runs: Runs, length: int) -> torch.Tensor:
        """uint8 [n, len(runs) * length]: per block, `length` consecutive fields from each run
        in turn; a run is (field index, offset of its first byte in the block). bits=8 reads
        whole bytes."""
        planes = self.planes(bits)
        count, size = planes.shape
        windows = planes.view(-1).as_strided((count * size - length + 1, length), (1, 1))
        n, type_size = self.blocks.shape
        return torch.index_select(windows, 0, _run_index(n, type_size, size, runs)).view(n, -1)

    def spread_bits(self, at: int, count: int) -> torch.Tensor:
        """uint8 [n, 8 * count] of 0/1: value 8i + k is bit k of byte at + i (the order of a
        little-endian bit mask's bits)."""
        words = self.gather(8, ((0, at),), count).long()
        for shift in (8, 16, 32):  # copy each byte into all eight bytes of its word
            words.bitwise_or_(words << shift)
        return words.bitwise_and_(_BIT_OF_EACH_BYTE).view(torch.uint8).ne_(0)


@functools.lru_cache(maxsize=32)
def _run_index(n: int, type_size: int, plane_size: int, runs: Runs) -> torch.Tensor:
    # a chunk's tensors differ only in n at a tensor's ragged end, so this is reused
    starts = torch.tensor([field * plane_size + offset for field, offset in runs])
    return (torch.arange(n)[:, None] * type_size + starts).view(-1)


def f16_column(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of every block, as float32 [n, 1] (one strided 1-D op)."""
    return blocks.view(torch.int16)[:, offset // 2].view(torch.float16).float()[:, None]

"""Dequantize GGUF tensor data to float32 with vectorized torch ops.

gguf.quants does the same in numpy, ~3x slower: it dominated loading a small model. Results
match gguf.quants bit for bit (the same float32 operations in the same order). Types without a
kernel here fall back to gguf.quants.

Torch's elementwise ops pay ~10 ns per row when rows are short and strided, which is what a
naive per-block formulation does (16-32 values per row). So a kernel instead works on a chunk
of blocks as one flat byte string: bit fields are cut out of every byte at once with int64 word
ops ("planes"), and one index_select of byte runs puts the fields in output order. Only the
per-block scales see short rows, and they are a few values per block. Chunks of about a million
values keep the temporaries small however large the tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from shoal.loader.gguf_planes import Chunk, f16_column

Kernel = Callable[[Chunk, torch.Tensor], None]
Q = GGMLQuantizationType

CHUNK_ELEMENTS = 1 << 20

_FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
# IQ4_NL's non-linear 4-bit grid (IQ4_XS's too) and MXFP4's e2m1 values, doubled
_IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10,
                            1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32)
_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                             dtype=torch.float32)


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Like gguf.quants.dequantize ([..., bytes_per_row] -> float32 [..., elements_per_row]),
    but always a fresh, writable, C-contiguous array (never a view of the file)."""
    kernel = _KERNELS.get(qtype)
    if kernel is None and qtype not in _FLOATS:
        values = gguf_dequantize(data, qtype)
        if not values.flags.writeable or not values.flags.c_contiguous \
                or values.dtype != np.float32:
            values = np.array(values, dtype=np.float32, order="C")
        return values
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(data).view(np.uint8)
    if raw.ndim == 0 or raw.shape[-1] % type_size:
        raise ValueError(f"{qtype.name} data of shape {raw.shape} is not whole rows of "
                         f"{type_size}-byte blocks")
    blocks = _readonly_tensor(raw).view(-1, type_size)
    # numpy, not torch.empty: numpy asks for transparent huge pages from 4 MiB on, and page
    # faults are much of the cost of writing a large fresh tensor (most of it in some VMs)
    values = np.empty((blocks.shape[0], block_size), dtype=np.float32)
    out = torch.from_numpy(values)
    if kernel is None:  # plain floats: one converting copy, no temporaries
        out.copy_(blocks.view(_FLOATS[qtype]))
    else:
        step = max(8, CHUNK_ELEMENTS // block_size // 8 * 8)  # whole int64 words per chunk
        for start in range(0, blocks.shape[0], step):
            kernel(Chunk(blocks[start:start + step]), out[start:start + step])
    return values.reshape(*raw.shape[:-1], raw.shape[-1] // type_size * block_size)


def _readonly_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over a possibly read-only array (a view of the file's memmap); only read."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _q4_0(chunk: Chunk, out: torch.Tensor) -> None:
    q = chunk.gather(4, ((0, 2), (1, 2)), 16).view(torch.int8).sub_(8)
    out.copy_(q).mul_(f16_column(chunk.blocks, 0))


def _q4_1(chunk: Chunk, out: torch.Tensor) -> None:
    out.copy_(chunk.gather(4, ((0, 4), (1, 4)), 16))
    out.mul_(f16_column(chunk.blocks, 0)).add_(f16_column(chunk.blocks, 2))


def _q5(chunk: Chunk, qh_at: int) -> torch.Tensor:
    """Q5_0/Q5_1's 5-bit quants: nibbles, and bit j of the little-endian uint32 as bit 4."""
    q = chunk.gather(4, ((0, qh_at + 4), (1, qh_at + 4)), 16)
    return q.bitwise_or_(chunk.spread_bits(qh_at, 4).bitwise_left_shift_(4))


def _q5_0(chunk: Chunk, out: torch.Tensor) -> None:
    out.copy_(_q5(chunk, 2).view(torch.int8).sub_(16)).mul_(f16_column(chunk.blocks, 0))


def _q5_1(chunk: Chunk, out: torch.Tensor) -> None:
    out.copy_(_q5(chunk, 4)).mul_(f16_column(chunk.blocks, 0)).add_(f16_column(chunk.blocks, 2))


def _q8_0(chunk: Chunk, out: torch.Tensor) -> None:
    out.copy_(chunk.gather(8, ((0, 2),), 32).view(torch.int8)).mul_(f16_column(chunk.blocks, 0))


def _crumb_runs(at: int) -> tuple[tuple[int, int], ...]:
    """Value 128h + 32s + j is 2-bit field s of byte at + 32h + j (Q2_K, Q3_K, Q6_K)."""
    return tuple((s, at + 32 * half) for half in range(2) for s in range(4))


_BIT_RUNS = {at: tuple((bit, at) for bit in range(8)) for at in (0, 16)}  # 32i + j: bit i of j


def _q2_k(chunk: Chunk, out: torch.Tensor) -> None:
    out.copy_(chunk.gather(2, _crumb_runs(16), 32))
    scales = chunk.gather(4, ((0, 0), (1, 0)), 16).float()  # 16 scales, then 16 mins
    d = f16_column(chunk.blocks, 80) * scales[:, :16]
    dmin = f16_column(chunk.blocks, 82) * scales[:, 16:]
    out.view(-1, 16, 16).mul_(d[..., None]).sub_(dmin[..., None])


def _q3_k(chunk: Chunk, out: torch.Tensor) -> None:
    # a clear high bit means "minus 4": value = low 2 bits + 4 * high bit - 4
    q = chunk.gather(2, _crumb_runs(32), 32)
    q.bitwise_or_(chunk.gather(1, _BIT_RUNS[0], 32).bitwise_left_shift_(2))
    out.copy_(q.view(torch.int8).sub_(4))
    # sixteen 6-bit scales: low nibbles in bytes 96-103, 2-bit highs in 104-107
    low = chunk.gather(4, ((0, 96), (1, 96)), 8)
    high = chunk.gather(2, tuple((s, 104) for s in range(4)), 4)
    scales = low.bitwise_or_(high.bitwise_left_shift_(4)).float().sub_(32)
    out.view(-1, 16, 16).mul_((f16_column(chunk.blocks, 108) * scales)[..., None])


def _k_scales(chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins in bytes 4-15, read as three uint32 words per
    block: a (bytes 4-7) holds scales 0-3 and, in each byte's top 2 bits, the high bits of
    scales 4-7; b (8-11) the same for mins; c (12-15) the low nibbles of scales 4-7 and, in
    its high nibbles, of mins 4-7."""
    words = chunk.blocks.view(torch.int32)
    a, b, c = words[:, 1], words[:, 2], words[:, 3]
    low6, low4, top2 = 0x3F3F3F3F, 0x0F0F0F0F, 0x30303030
    scales = torch.empty(len(a), 2, dtype=torch.int32)
    mins = torch.empty(len(a), 2, dtype=torch.int32)
    torch.bitwise_and(a, low6, out=scales[:, 0])
    torch.bitwise_or(c & low4, (a >> 2) & top2, out=scales[:, 1])
    torch.bitwise_and(b, low6, out=mins[:, 0])
    torch.bitwise_or((c >> 4) & low4, (b >> 2) & top2, out=mins[:, 1])
    d = f16_column(chunk.blocks, 0) * scales.view(torch.uint8)
    dmin = f16_column(chunk.blocks, 2) * mins.view(torch.uint8)
    return d, dmin


_Q4_K_RUNS = tuple((nibble, 16 + 32 * group) for group in range(4) for nibble in range(2))


def _scale_min(chunk: Chunk, out: torch.Tensor) -> None:
    """out = (d * scale) * q - dmin * min over Q4_K/Q5_K's eight sub-blocks of 32."""
    d, dmin = _k_scales(chunk)
    out.view(-1, 8, 32).mul_(d[..., None]).sub_(dmin[..., None])


def _q4_k(chunk: Chunk, out: torch.Tensor) -> None:
    out.copy_(chunk.gather(4, _Q4_K_RUNS, 32))
    _scale_min(chunk, out)


def _q5_k(chunk: Chunk, out: torch.Tensor) -> None:
    q = chunk.gather(4, tuple((n, at + 32) for n, at in _Q4_K_RUNS), 32)
    out.copy_(q.bitwise_or_(chunk.gather(1, _BIT_RUNS[16], 32).bitwise_left_shift_(4)))
    _scale_min(chunk, out)


# per half of 128 values: 64 bytes of low nibbles (values 0-63, then 64-127 from the high
# nibbles) and 32 bytes of 2-bit highs
_Q6_K_RUNS = tuple((nibble, 64 * half + 32 * part)
                   for half in range(2) for nibble in range(2) for part in range(2))


def _q6_k(chunk: Chunk, out: torch.Tensor) -> None:
    q = chunk.gather(4, _Q6_K_RUNS, 32)
    q.bitwise_or_(chunk.gather(2, _crumb_runs(128), 32).bitwise_left_shift_(4))
    scales = chunk.gather(8, ((0, 192),), 16).view(torch.int8)
    out.copy_(q.view(torch.int8).sub_(32))
    out.view(-1, 16, 16).mul_((f16_column(chunk.blocks, 208) * scales)[..., None])


def _q8_k(chunk: Chunk, out: torch.Tensor) -> None:
    # float32 d, 256 int8 quants, then 16 int16 sums that dequantizing ignores
    d = chunk.blocks.view(torch.float32)[:, :1]
    out.copy_(chunk.gather(8, ((0, 4),), 256).view(torch.int8)).mul_(d)


def _lookup(table: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(table, 0, index.view(-1).long(), out=out.view(-1))


def _iq4_nl(chunk: Chunk, out: torch.Tensor) -> None:
    _lookup(_IQ4_VALUES, chunk.gather(4, ((0, 2), (1, 2)), 16), out)
    out.mul_(f16_column(chunk.blocks, 0))


def _iq4_xs(chunk: Chunk, out: torch.Tensor) -> None:
    # eight 6-bit scales: nibble i % 2 of byte 4 + i // 2, over 2-bit field i of the uint16 at 2
    low = chunk.gather(4, tuple((i % 2, 4 + i // 2) for i in range(8)), 1)
    high = chunk.gather(2, tuple((i % 4, 2 + i // 4) for i in range(8)), 1)
    scales = low.bitwise_or_(high.bitwise_left_shift_(4)).float().sub_(32)
    _lookup(_IQ4_VALUES, chunk.gather(4, tuple((n, 8 + 16 * g) for g in range(8)
                                              for n in range(2)), 16), out)
    out.view(-1, 8, 32).mul_((f16_column(chunk.blocks, 0) * scales)[..., None])


def _mxfp4(chunk: Chunk, out: torch.Tensor) -> None:
    # the e8m0 exponent byte as half its power of two (the values are doubled)
    e = chunk.blocks[:, 0].int()
    bits = torch.where(e < 2, torch.bitwise_left_shift(0x00200000, e), (e - 1) << 23)
    _lookup(_MXFP4_VALUES, chunk.gather(4, ((0, 1), (1, 1)), 16), out)
    out.mul_(bits.view(torch.float32)[:, None])


_KERNELS: dict[GGMLQuantizationType, Kernel] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.Q8_K: _q8_k,
    Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs, Q.MXFP4: _mxfp4,
}


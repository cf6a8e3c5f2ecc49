"""Block-scaled FP8 rows (shoal/attention/fp8_rows.py), what kv_cache_dtype="fp8" keeps for
DeepSeek-V3.2's indexer keys and V4's window rows and compressed entries: the byte layout,
the rounding error (every value within half an e4m3 step of its block's grid, whatever the
row's size, where one fixed scale flushes small rows), zero rows, segments read alone, and
bad input refused."""

from __future__ import annotations

import pytest
import torch

from shoal.attention import kv_quant
from shoal.attention.fp8_rows import INDEXER_KEY_BLOCK, KV_ROW_BLOCK, BlockScaledRows


def test_layout_of_v4_and_v32_rows() -> None:
    # V4-Flash's CSA entry: its 512-wide key in blocks of 64, then the indexer's 128 in one;
    # 676 bytes of values and scales, padded to 688 (rows 16-byte aligned for the GPU)
    csa = BlockScaledRows.of((512, KV_ROW_BLOCK), (128, INDEXER_KEY_BLOCK))
    assert csa.segments == ((512, 64), (128, 128))
    assert (csa.width, csa.num_scales, csa.scales_end, csa.row_bytes) == (640, 9, 676, 688)
    assert csa.scales_of(0, 512) == (160, 64)  # float32 word 160: byte 640
    assert csa.scales_of(512, 128) == (168, 128)
    # V4's window rows and HCA entries: 512 + 8 scales, already a multiple of 16
    assert BlockScaledRows.of((512, KV_ROW_BLOCK)).row_bytes == 544
    # V3.2's indexer key: one scale for its 128 values (132 bytes) padded to 144; a tiny
    # model's widths (no 64 / 128)
    v32 = BlockScaledRows.of((128, INDEXER_KEY_BLOCK))
    assert (v32.scales_end, v32.row_bytes) == (132, 144)
    assert BlockScaledRows.of((32, KV_ROW_BLOCK), (0, 128)).segments == ((32, 32),)
    assert BlockScaledRows.of((96, KV_ROW_BLOCK)).segments == ((96, 32),)
    odd = BlockScaledRows.of((6, 64))  # blocks of 2; values padded to 4 bytes, 3 scales
    assert (odd.segments, odd.values_bytes, odd.scales_end, odd.row_bytes) == \
        (((6, 2),), 8, 20, 32)


@pytest.mark.parametrize("parts", [((512, 64), (128, 128)), ((128, 128),), ((6, 64),),
                                   ((32, 8), (32, 16)), ((512, 64),)])
def test_rows_are_padded_to_16_bytes_with_zeros_after_the_scales(parts) -> None:
    """Every row a multiple of 16 bytes (so each row of a page starts 16-byte aligned: the
    GPU kernels' vector loads), the scales right after the values, the tail zeros."""
    fmt = BlockScaledRows.of(*parts)
    assert fmt.row_bytes % 16 == 0 and 0 <= fmt.row_bytes - fmt.scales_end < 16
    x = torch.randn(3, fmt.width, generator=torch.Generator().manual_seed(2)) + 0.5
    stored = fmt.quantize(x)
    assert stored.shape == (3, fmt.row_bytes)
    assert torch.count_nonzero(stored[:, fmt.scales_end:]) == 0
    scales = stored[:, fmt.values_bytes:fmt.scales_end].contiguous().view(torch.float32)
    start = first = 0
    for w, b in fmt.segments:  # each block's largest |value| / 448, in column order
        amax = x[:, start:start + w].unflatten(-1, (w // b, b)).abs().amax(-1)
        assert torch.equal(scales[:, first:first + w // b], amax / kv_quant.FP8_MAX)
        start, first = start + w, first + w // b
    # garbage in the padding is never read
    dirty = stored.clone()
    dirty[:, fmt.scales_end:] = 0x7F
    assert torch.equal(fmt.dequantize(dirty, torch.float32), fmt.dequantize(stored,
                                                                            torch.float32))


def test_round_trip_is_within_half_an_fp8_step_of_each_block_whatever_the_size() -> None:
    fmt = BlockScaledRows.of((64, 32), (32, 128))
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor([1e-4, 1e-2, 1.0, 30.0, 5e3]).view(-1, 1, 1)
    x = torch.randn(5, 40, 96, generator=gen) * sizes
    stored = fmt.quantize(x)
    assert stored.dtype == torch.uint8 and stored.shape == (5, 40, fmt.row_bytes)
    got = fmt.dequantize(stored, torch.float32)
    for lo, hi in ((0, 32), (32, 64), (64, 96)):
        block = x[..., lo:hi]
        scale = block.abs().amax(-1, keepdim=True) / kv_quant.FP8_MAX
        err = (got[..., lo:hi] - block).abs()
        # e4m3: 3 mantissa bits (a relative step of 2^-3) above 2^-6, steps of 2^-9 below
        assert torch.all(err <= torch.maximum(block.abs() * 2.0 ** -4, scale * 2.0 ** -10))
        # the block's largest value is kept (within float32 rounding of the scale)
        torch.testing.assert_close(got[..., lo:hi].abs().amax(-1), block.abs().amax(-1))
    # one fixed scale of 1.0 (kv_quant's default) flushes the small rows to zero
    assert kv_quant.round_trip(x[0], 1.0).abs().max() == 0
    assert fmt.round_trip(x[0]).abs().max() > 0
    assert fmt.round_trip(x.bfloat16()).dtype == torch.bfloat16


def test_zero_rows_and_zeroed_pages_read_zero() -> None:
    fmt = BlockScaledRows.of((32, 64))
    assert torch.equal(fmt.round_trip(torch.zeros(3, 32)), torch.zeros(3, 32))
    zeroed = torch.zeros(2, fmt.row_bytes, dtype=kv_quant.FP8_KV_DTYPE)  # a freed block's bytes
    assert torch.equal(fmt.dequantize(zeroed, torch.float32), torch.zeros(2, 32))
    # a block so tiny its scale underflows to 0 (float32 subnormals) reads 0, never NaN
    tiny = torch.zeros(1, 32)
    tiny[0, 1] = 1e-44
    assert torch.equal(fmt.round_trip(tiny), torch.zeros(1, 32))


def test_a_segment_is_read_alone() -> None:
    fmt = BlockScaledRows.of((64, 64), (32, 128))
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    stored = fmt.quantize(x)
    whole = fmt.dequantize(stored, torch.float32)
    assert torch.equal(fmt.dequantize(stored, torch.float32, slice(64, None)), whole[:, 64:])
    assert torch.equal(fmt.dequantize(stored, torch.float32, slice(0, 64)), whole[:, :64])


def test_bad_layouts_and_reads_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of its block"):
        BlockScaledRows(((48, 32),))
    with pytest.raises(ValueError, match="at least one segment"):
        BlockScaledRows.of((0, 64))
    fmt = BlockScaledRows.of((64, 32))
    with pytest.raises(ValueError, match="rows of 48 values"):
        fmt.quantize(torch.zeros(2, 48))
    stored = fmt.quantize(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="stored rows of 76 bytes, the layout's are 80"):
        fmt.dequantize(stored[:, :76], torch.float32)  # (its values and scales, unpadded)
    with pytest.raises(ValueError, match="cut a block of 32"):
        fmt.dequantize(stored, torch.float32, slice(0, 40))
    with pytest.raises(ValueError, match="not whole blocks"):
        fmt.scales_of(16, 32)

"""shoal's torch dequantization against gguf.quants (the oracle), bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as oracle
from gguf.quants import quantize

from shoal.loader import gguf_dequant
from shoal.loader.gguf_dequant import dequantize
from shoal.loader.gguf_file import open_gguf

Q = GGMLQuantizationType
# gguf can quantize these; the others get random bytes with finite scales planted
QUANTIZABLE = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4,
               Q.TQ2_0}
# byte offsets of each block's float16 scales (random bytes there could be inf or NaN)
F16_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
              Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}
KERNEL_TYPES = sorted(QUANTIZABLE - {Q.TQ2_0} | set(F16_SCALES) | {Q.Q8_K}, key=int)
WITH_ORACLE = [qtype for qtype in KERNEL_TYPES if qtype != Q.Q8_K]  # gguf lacks Q8_K


def make_rows(qtype: GGMLQuantizationType, shape: tuple[int, ...], blocks_per_row: int,
              seed: int = 0) -> np.ndarray:
    """Quantized rows [*shape, bytes]."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in QUANTIZABLE:
        values = rng.standard_normal((*shape, blocks_per_row * block_size)).astype(np.float32)
        values[..., :block_size] = 0  # an all-zero block: zero scales, -0.0 products
        return quantize(values, qtype)
    data = rng.integers(0, 256, (*shape, blocks_per_row * type_size), dtype=np.uint8)
    blocks = data.reshape(-1, type_size)
    for offset in F16_SCALES.get(qtype, ()):
        scales = rng.standard_normal((len(blocks), 1)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8)
    if qtype == Q.Q8_K:
        blocks[:, :4] = rng.standard_normal((len(blocks), 1)).astype(np.float32).view(np.uint8)
    return data


def assert_bitwise_equal(ours: np.ndarray, expected: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    np.testing.assert_array_equal(ours.view(np.uint32), expected.astype(np.float32)
                                  .view(np.uint32))


@pytest.mark.parametrize("qtype", WITH_ORACLE, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(1,), (7,), (2, 3)], ids=["1row", "7rows", "2x3rows"])
def test_matches_gguf_bit_for_bit(qtype, shape):
    data = make_rows(qtype, shape, blocks_per_row=3)
    assert_bitwise_equal(dequantize(data, qtype), oracle(data, qtype))


@pytest.mark.parametrize("qtype", WITH_ORACLE, ids=lambda q: q.name)
def test_chunks_and_ragged_last_chunk(qtype, monkeypatch):
    # 8-16 blocks per chunk: 39 blocks end in a partial chunk whose bytes are not whole int64
    # words for odd block sizes (MXFP4's 17 bytes)
    monkeypatch.setattr(gguf_dequant, "CHUNK_ELEMENTS", 512)
    data = make_rows(qtype, (13,), blocks_per_row=3, seed=1)
    assert_bitwise_equal(dequantize(data, qtype), oracle(data, qtype))


def test_q8_k():
    data = make_rows(Q.Q8_K, (5,), blocks_per_row=2)
    blocks = data.reshape(-1, GGML_QUANT_SIZES[Q.Q8_K][1])
    d = blocks[:, :4].copy().view(np.float32)
    quants = blocks[:, 4:260].view(np.int8).astype(np.float32)
    assert_bitwise_equal(dequantize(data, Q.Q8_K), (d * quants).reshape(5, 512))


def test_fallback_to_gguf_for_other_types():
    data = make_rows(Q.TQ2_0, (3,), blocks_per_row=2)
    ours = dequantize(data, Q.TQ2_0)
    assert_bitwise_equal(ours, oracle(data, Q.TQ2_0))
    assert ours.flags.writeable and ours.flags.c_contiguous


def test_fresh_writable_array_even_for_f32():
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    data.flags.writeable = False
    ours = dequantize(data, Q.F32)
    assert ours.flags.writeable and ours.flags.c_contiguous
    assert not np.shares_memory(ours, data)
    np.testing.assert_array_equal(ours, data)


def test_non_contiguous_input():
    data = make_rows(Q.Q4_1, (8,), blocks_per_row=2)[::2]
    assert_bitwise_equal(dequantize(data, Q.Q4_1), oracle(np.ascontiguousarray(data), Q.Q4_1))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.F32])
def test_results_are_fresh_writable_arrays(qtype):
    # The loader hands them to torch.from_numpy without a copy: a read-only view of the
    # file's mapping (what gguf.quants returns for F32) would have to be copied first.
    data = make_rows(qtype, (2, 2), blocks_per_row=1)
    data.flags.writeable = False  # as the file's mapping is
    values = dequantize(data, qtype)
    assert values.dtype == np.float32 and values.flags.writeable and values.flags.c_contiguous
    assert not np.shares_memory(values, data)
    assert values.shape[:2] == (2, 2)
    assert_bitwise_equal(values, oracle(data, qtype))


def test_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="Q4_0"):
        dequantize(np.zeros((2, 19), dtype=np.uint8), Q.Q4_0)


@pytest.fixture(scope="module")
def smollm_tensors(smollm_gguf):
    folder, name = smollm_gguf
    return {tensor.name: tensor for tensor in open_gguf(Path(folder) / name).reader.tensors}


@pytest.mark.parametrize("name", ["blk.0.attn_k.weight", "blk.0.ffn_down.weight",
                                  "blk.0.attn_norm.weight", "token_embd.weight"])
def test_smollm2_tensors(smollm_tensors, name):
    tensor = smollm_tensors[name]
    data = tensor.data[:2048]  # Q4_1, F32 and Q8_0 (of which 2048 of 49152 rows)
    assert_bitwise_equal(dequantize(data, tensor.tensor_type), oracle(data, tensor.tensor_type))

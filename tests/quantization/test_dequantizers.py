"""Each dequantizer on a random matrix, against the weight the test's own quantizer says the
stored tensors stand for (quant_checkpoints.py), and against the original matrix within the
format's rounding."""

from __future__ import annotations

import pytest
import quant_checkpoints as qc
import torch
from quant_cases import CASES

from shoal.quantization.awq import dequantize_awq
from shoal.quantization.compressed_tensors import CompressedTensorsLayout
from shoal.quantization.fp8 import dequantize_fp8, fp8_round_trip
from shoal.quantization.gptq import dequantize_gptq
from shoal.quantization.packing import unpack_int32


def _matrix(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _rel_err(got: torch.Tensor, w: torch.Tensor) -> float:
    return float((got - w).norm() / w.norm())


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_int32_reads_each_value_at_its_bits(bits):
    codes = torch.randint(0, 2**bits, (16, 24), generator=torch.Generator().manual_seed(bits))
    packed_rows, packed_cols = qc.pack_rows(codes, bits), qc.pack_cols(codes, bits)
    assert torch.equal(unpack_int32(packed_rows, bits, dim=0), codes.to(torch.int32))
    assert torch.equal(unpack_int32(packed_cols, bits, dim=1), codes.to(torch.int32))
    # the top value sets the sign bit of its word: the arithmetic shift must not leak it
    top = torch.full((8, 8), 2**bits - 1)
    assert torch.equal(unpack_int32(qc.pack_rows(top, bits), bits, dim=0), top.int())


@pytest.mark.parametrize("shape", [(300, 260), (256, 512)])
def test_fp8_block_scales_with_partial_edge_tiles(shape):
    w = _matrix(*shape)
    q = qc.fp8_block(w, (128, 128))
    got = dequantize_fp8(q.stored["weight"], q.stored["weight_scale_inv"], (128, 128))
    assert torch.equal(got, q.reference)
    assert _rel_err(got, w) < 0.04  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_per_channel_and_per_tensor_scales(per_tensor):
    w = _matrix(96, 200)
    q = qc.fp8_rows(w, per_tensor=per_tensor)
    assert torch.equal(dequantize_fp8(q.stored["weight"], q.stored["weight_scale"]), q.reference)
    flat = q.stored["weight_scale"].reshape(-1)  # [N] rather than [N, 1]
    assert torch.equal(dequantize_fp8(q.stored["weight"], flat), q.reference)


def test_fp8_scale_that_fits_no_layout_is_refused():
    w = qc.fp8_rows(_matrix(64, 64)).stored["weight"]
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(3, 1\)"):
        dequantize_fp8(w, torch.ones(3, 1), (32, 32))
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_fp8(w, torch.ones(5))


def test_online_fp8_is_per_channel_e4m3_rounding():
    w = _matrix(64, 128)
    w[3] *= 100  # one large row does not coarsen the others (per-channel scales)
    got = fp8_round_trip(w)
    assert torch.equal(got, qc.online_fp8_reference(w))
    assert _rel_err(got[:3], w[:3]) < 0.04
    assert torch.equal(fp8_round_trip(torch.zeros(4, 8)), torch.zeros(4, 8))


@pytest.mark.parametrize("bits,group,act_order,sym,v1", [
    (4, 128, False, True, True), (4, 128, True, True, True), (4, -1, False, False, False),
    (8, 32, True, False, True), (8, 128, False, True, False),
])
def test_gptq_matches_its_reference(bits, group, act_order, sym, v1):
    w = _matrix(256, 512, seed=bits)
    q = qc.gptq(w, bits, group, act_order=act_order, sym=sym, v1=v1)
    s = q.stored
    g_idx = s["g_idx"] if act_order else None  # without act-order: recomputed
    got = dequantize_gptq(s["qweight"], s["qzeros"], s["scales"], g_idx, bits, group,
                          v1_zeros=v1)
    assert torch.equal(got, q.reference)
    assert _rel_err(got, w) < (0.15 if bits == 4 else 0.01)


def test_gptq_act_order_really_needs_g_idx():
    w = _matrix(64, 256)
    q = qc.gptq(w, 4, 32, act_order=True)
    s = q.stored
    sequential = dequantize_gptq(s["qweight"], s["qzeros"], s["scales"], None, 4, 32)
    assert not torch.allclose(sequential, q.reference)


@pytest.mark.parametrize("group", [32, 128])
def test_awq_undoes_the_gemm_interleave(group):
    w = _matrix(256, 512, seed=group)
    q = qc.awq(w, group)
    got = dequantize_awq(q.stored["qweight"], q.stored["qzeros"], q.stored["scales"], group)
    assert torch.equal(got, q.reference)
    assert _rel_err(got, w) < 0.15


@pytest.mark.parametrize("fmt", [f for f in CASES if f.startswith("ct-")] + ["ct-w4a16-g128"])
def test_compressed_tensors_decompress_matches_its_reference(fmt):
    if fmt == "ct-w4a16-g128":
        weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                   "group_size": 128}
        scheme = qc.ct_scheme(weights)
        config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                  "config_groups": {"g": scheme}}
        quantize = lambda w: qc.ct_quantize(w, scheme, "pack-quantized")  # noqa: E731
    else:
        config, quantize = CASES[fmt].config, CASES[fmt].quantize
    layout = CompressedTensorsLayout(config)
    w = _matrix(192, 256)
    q = quantize(w)
    group = layout.scheme_for("model.layers.0.mlp.down_proj")
    assert set(q.stored) == set(group.param_names())
    got = layout.decompress("m", group, q.stored)
    assert torch.equal(got, q.reference)
    assert _rel_err(got, w) < (0.15 if "w4" in fmt else 0.04)


@pytest.mark.parametrize("shape", [(256, 384), (300, 260)])
def test_compressed_tensors_fp8_block_scales(shape):
    """llm-compressor's FP8_BLOCK: DeepSeek's tiles under compressed-tensors' names."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
               "block_structure": [128, 128]}
    layout = CompressedTensorsLayout({"quant_method": "compressed-tensors",
                                      "format": "float-quantized",
                                      "config_groups": {"g": qc.ct_scheme(weights)}})
    q = qc.fp8_block(_matrix(*shape), (128, 128))
    stored = {"weight": q.stored["weight"], "weight_scale": q.stored["weight_scale_inv"]}
    got = layout.decompress("m", layout.scheme_for("m"), stored)
    assert torch.equal(got, q.reference)

"""SHOAL_INT4_TILED: an INT4 layer's second copy of its codes in tile_codes' layout, and the
decode tuner's tensor-core candidates that read it (decode_gemv, methods.Int4Linear), in
Triton's interpreter on the CPU: the tiled candidates give the bits of the plain ones; the
GPU candidate list gains them only with a copy of their width; only CUDA layers keep one."""

from __future__ import annotations

import pytest
import torch
from test_int4_mma_gemv import _problem

from shoal.layers.quantization import decode_gemv, methods
from shoal.layers.quantization import int4_mma_gemv as mma
from shoal.layers.quantization.decode_gemv import GemvTiles
from shoal.quantization.packed import PackedLinear


def test_int4_gemv_reads_tiled_codes_for_tiled_mma_tiles():
    x, codes, scales, _, _ = _problem(2, 64, 256, 128, False, torch.bfloat16, seed=1)
    plain = GemvTiles(32, 128, 2, num_warps=4, num_stages=1, kernel="mma")
    tiled = GemvTiles(32, 128, 2, num_warps=4, num_stages=1, kernel="mma", tiled=True)
    want = decode_gemv.int4_gemv(x, codes, scales, None, 128, plain)
    copy = mma.tile_codes(codes, 32, 16)
    assert torch.equal(decode_gemv.int4_gemv(x, copy, scales, None, 128, tiled), want)
    with pytest.raises(ValueError, match="'mma' kernel"):
        decode_gemv.int4_gemv(x, copy, scales, None, 128,
                              GemvTiles(32, 128, 2, kernel="wide", tiled=True))


def test_the_gpu_list_gains_tiled_tiles_of_the_copys_width(monkeypatch):
    dev = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: type("P", (), {"multi_processor_count": 132})())
    monkeypatch.setattr(torch.version, "hip", None)
    plain = decode_gemv._mma(28672, 4096, 128, dev, torch.bfloat16)
    assert not any(t.tiled for t in plain)
    both = decode_gemv._mma(28672, 4096, 128, dev, torch.bfloat16, mma.TILED_BLOCK_N)
    extra = both[len(plain):]
    assert both[:len(plain)] == plain and extra
    assert all(t.tiled and t.block_n == mma.TILED_BLOCK_N and t.block_k == 8 * mma.TILED_WORDS
               for t in extra)
    # each plain tile of the copy's width, once more (its warps and splits too)
    same = [t for t in plain if t.block_n == mma.TILED_BLOCK_N]
    assert [(t.split, t.num_warps) for t in extra] == [(t.split, t.num_warps) for t in same]
    assert "tiled" in methods._gemv_name(extra[0])
    assert "tiled" not in methods._gemv_name(same[0])


def test_an_int4_layer_dispatches_each_candidate_to_its_codes(monkeypatch):
    """Every candidate of the layer's decode path (tuner bypassed: each name run) on a layer
    with a tiled copy: the plain and tiled tensor-core tiles agree bit for bit."""
    # fp16: the interpreter's bf16 dots (w4a16 gemm's) are garbage (interpreted_half.py)
    x, codes, scales, _, _ = _problem(1, 64, 256, 128, False, torch.float16, seed=2)
    copy = mma.tile_codes(codes, 32, 16)
    layer = methods.Int4Linear(codes, scales, None, 128, 256, tiled=copy)
    assert "tiled copy" in layer.name
    assert layer.nbytes == 2 * codes.numel() * 4 + scales.numel() * 2
    tiles = {"mma": GemvTiles(32, 128, 2, num_warps=4, num_stages=1, kernel="mma"),
             "mma tiled": GemvTiles(32, 128, 2, num_warps=4, num_stages=1, kernel="mma",
                                    tiled=True)}
    monkeypatch.setattr(methods, "_int4_candidates", lambda *a, **kw: methods._Candidates(
        ("w4a16 gemm", *tiles), tiles))
    outs = {}

    def every(key, names, run, device, agree=None):
        outs.update({name: run(name) for name in names})
        return outs[names[0]]

    monkeypatch.setattr(methods, "run_fastest", every)
    layer(x)
    assert torch.equal(outs["mma"], outs["mma tiled"])
    torch.testing.assert_close(outs["mma"].float(), outs["w4a16 gemm"].float(), rtol=2e-2,
                               atol=2e-2)


def test_only_cuda_layers_keep_a_tiled_copy(monkeypatch):
    monkeypatch.setenv("SHOAL_INT4_TILED", "1")
    k, n = 256, 256
    codes = torch.randint(-(1 << 31), 1 << 31, (n, k // 8), dtype=torch.int64).to(torch.int32)
    packed = PackedLinear("int4", k, 128, {"codes": codes,
                                           "scale": torch.full((n, k // 128), 0.01),
                                           "zero": torch.full((n, k // 128), 8,
                                                              dtype=torch.uint8)})
    layer = methods._int4(packed, torch.device("cpu"))
    assert layer is not None and layer.tiled is None

"""The fast path's Triton kernels (shoal/layers/quantization) against plain PyTorch: weights
dequantized to float32, then one float32 matmul. On the CPU they run in Triton's interpreter
(conftest.py) on small shapes: odd M, K not a multiple of the group, asymmetric zero points,
the split-K decode tiles and the one-tile prefill ones."""

from __future__ import annotations

import pytest
import torch

from shoal.layers.quantization.fp8_block_gemm import fp8_block_matmul
from shoal.layers.quantization.fp8_quant import (
    quantize_fp8_groups,
    quantize_fp8_groups_reference,
)
from shoal.layers.quantization.tiles import choose
from shoal.layers.quantization.w4a16_gemm import w4a16_matmul
from shoal.quantization.packed import dequantize_packed, quantize_fp8, quantize_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.float() - want).abs().max().item()
    assert err <= rel * want.abs().max().item() + 1e-6, (err, want.abs().max().item())


@pytest.mark.parametrize("m,k,group", [(1, 96, 32), (5, 200, 32), (3, 100, 100), (2, 64, 16)])
def test_fp8_activation_groups_match_the_reference_bit_for_bit(m, k, group):
    x = torch.randn(m, k, device=DEVICE) * torch.logspace(-2, 2, k, device=DEVICE)
    x[0, :group] = 0  # an all-zero group still gets a finite scale
    q, s = quantize_fp8_groups(x, group)
    q_ref, s_ref = quantize_fp8_groups_reference(x, group)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("m,n,k,block,scale_rows", [
    (1, 64, 512, (32, 32), 32),  # decode tiles, K split over programs, compact scales
    (3, 40, 200, (32, 32), 1),  # odd M, N and a partial last K group
    (70, 48, 96, (16, 32), 1),  # M past the decode tiles
])
def test_fp8_block_gemm_matches_dequantized_matmul(m, n, k, block, scale_rows):
    torch.manual_seed(0)
    w = torch.randn(n, k, device=DEVICE)
    p = quantize_fp8(w, block)
    scale = p.parts["scale"]
    if scale_rows > 1:  # one scale row per tile, as a checkpoint stores them
        assert torch.equal(scale, scale[::scale_rows].repeat_interleave(scale_rows, 0)[:n])
        scale = scale[::scale_rows].contiguous()
    x = torch.randn(m, k, device=DEVICE)
    q, s = quantize_fp8_groups(x, block[1])
    x_deq = q.float() * s.repeat_interleave(block[1], 1)[:, :k]
    want = x_deq @ dequantize_packed(p).t()
    got = fp8_block_matmul(q, s, p.parts["weight"], scale, block[1], scale_rows, torch.float32)
    _close(got, want, 1e-5)


@pytest.mark.parametrize("m,n,k,group,sym", [
    (1, 32, 512, 32, True),  # decode: K split over programs
    (7, 40, 200, 32, False),  # odd M and N, K not a multiple of the group, zero points
    (3, 24, 100, 32, False),  # K not a multiple of 8 (compressed-tensors packs densely)
    (2, 64, 256, 128, True),
    (5, 16, 96, -1, False),  # one group over all inputs (per channel)
    (70, 32, 64, 16, True),  # M past the decode tiles
])
def test_w4a16_gemm_matches_dequantized_matmul(m, n, k, group, sym):
    torch.manual_seed(1)
    p = quantize_int4(torch.randn(n, k, device=DEVICE), group, sym)
    x = torch.randn(m, k, device=DEVICE)
    want = x @ dequantize_packed(p).t()
    zeros = None if sym else p.parts["zero"].t().contiguous()
    got = w4a16_matmul(x, p.parts["codes"].t().contiguous(), p.parts["scale"].t().contiguous(),
                       zeros, p.group)
    _close(got, want, 1e-5)


def test_w4a16_tiles_too_big_for_shared_memory_shrink_until_they_fit(monkeypatch):
    """A launch refused for shared memory (an H200 refused 128 x 128 tiles over 3 stages)
    retries with fewer stages, then smaller tiles, and remembers what fit."""
    from triton.runtime.errors import OutOfResources

    from shoal.layers.quantization import w4a16_gemm

    real, launched = w4a16_gemm._w4a16_kernel, []

    class Fussy:  # refuses any config over 2 stages or 16 rows, as a small GPU would
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((kw["BLOCK_M"], kw["num_stages"]))
                if kw["num_stages"] > 2 or kw["BLOCK_M"] > 16:
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(w4a16_gemm, "_w4a16_kernel", Fussy())
    monkeypatch.setattr(w4a16_gemm, "_FITTED", {})
    torch.manual_seed(3)
    p = quantize_int4(torch.randn(32, 64, device=DEVICE), 16, True)
    x = torch.randn(70, 64, device=DEVICE)
    args = (p.parts["codes"].t().contiguous(), p.parts["scale"].t().contiguous(), None, 16)
    _close(w4a16_matmul(x, *args), x @ dequantize_packed(p).t(), 1e-5)
    assert launched[0] == (64, 3) and launched[-1] == (16, 2)
    launched.clear()
    w4a16_matmul(x, *args)  # the fitted tiles at once
    assert launched == [(16, 2)]


def test_decode_tiles_split_k_and_prefill_tiles_do_not():
    cpu = torch.device("cpu")
    assert choose(1, 32, 512, 32, cpu).split_k > 1
    assert choose(2048, 4096, 4096, 128, cpu).split_k == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA (Triton's interpreter computes bfloat16 dots wrongly)")
def test_w4a16_in_bfloat16_is_within_bfloat16_rounding():
    torch.manual_seed(2)
    p = quantize_int4(torch.randn(48, 128, device=DEVICE), 32, False)
    x = torch.randn(4, 128, device=DEVICE)
    want = x.bfloat16().float() @ dequantize_packed(p).t()
    got = w4a16_matmul(x.bfloat16(), p.parts["codes"].t().contiguous(),
                       p.parts["scale"].t().contiguous(), p.parts["zero"].t().contiguous(), 32)
    assert got.dtype == torch.bfloat16
    _close(got, want, 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm in bf16 needs CUDA")
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_methods_on_cuda_in_bfloat16(block):
    from shoal.layers.quantization.methods import make_quant_linear

    torch.manual_seed(5)
    p = quantize_fp8(torch.randn(256, 384, device="cuda"), block)
    q = make_quant_linear(p, torch.device("cuda"))
    x = torch.randn(7, 384, device="cuda", dtype=torch.bfloat16)
    group = 384 if block is None else block[1]
    xq, s = quantize_fp8_groups_reference(x, group)
    want = (xq.float() * s.repeat_interleave(group, 1)[:, :384]) @ dequantize_packed(p).t()
    got = q(x)
    assert got.dtype == torch.bfloat16
    _close(got, want, 2e-2)

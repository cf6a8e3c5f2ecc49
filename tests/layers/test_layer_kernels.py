"""The Triton kernels of the layers around attention (RMSNorm, SiLU-and-mul, rotary) against
the layers' PyTorch paths, through the Triton interpreter on the CPU (see conftest.py;
compiled on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from shoal.layers.activation import SiluAndMul  # noqa: E402
from shoal.layers.norm import RMSNorm  # noqa: E402
from shoal.layers.ops.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from shoal.layers.ops.rotary import rotary_embedding  # noqa: E402
from shoal.layers.ops.silu_mul import silu_and_mul  # noqa: E402
from shoal.layers.rotary import RotaryEmbedding  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 48])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(13)
    norm = RMSNorm(hidden, eps=1e-5, params_dtype=dtype).to(DEV)
    norm.weight.data = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(DEV, dtype)
    x = torch.randn(3, hidden, generator=gen).to(DEV, dtype)
    res = torch.randn(3, hidden, generator=gen).to(DEV, dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-5), norm.forward_native(x), atol=tol,
                               rtol=tol)
    ref_out, ref_res = norm.forward_native(x, res)
    xc, rc = x.clone(), res.clone()
    out, new_res = fused_add_rms_norm(xc, rc, norm.weight, 1e-5)
    assert out.data_ptr() == xc.data_ptr() and new_res.data_ptr() == rc.data_ptr()
    # Exact on the GPU; the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even).
    ulp = 2.0 ** -7 if INTERPRET and dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=ulp)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [None, 32])
def test_rotary(dtype: torch.dtype, rot_dim: int | None) -> None:
    gen = torch.Generator().manual_seed(14)
    t, hq, hk, d = 4, 4, 2, 64
    rope = RotaryEmbedding(d, 100, 10000.0, rot_dim=rot_dim).to(DEV)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(DEV, dtype)
    q = qkv[:, :hq * d].view(t, hq, d)  # strided views, rotated in place
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    pos = torch.tensor([0, 5, 99, 17], device=DEV)
    ref_q, ref_k = rope.forward_native(pos, q, k)
    v_before = qkv[:, (hq + hk) * d:].clone()
    got_q, got_k = rotary_embedding(pos, q, k, rope.cos_sin_cache)
    assert got_q.data_ptr() == q.data_ptr()
    tol = TOL[dtype]
    torch.testing.assert_close(q, ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, ref_k, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(15)
    x = (torch.randn(3, 2 * 1100, generator=gen) * 3).to(DEV, dtype)  # 2 ragged col blocks
    tol = TOL[dtype]
    torch.testing.assert_close(silu_and_mul(x), SiluAndMul().forward_native(x), atol=tol, rtol=tol)

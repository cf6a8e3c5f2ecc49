"""The gated attention output o * sigmoid(gate) in one Triton launch (layers/ops/
sigmoid_gate.py), interpreted on the CPU (this directory's conftest.py): the gate read as the
strided view the q projection leaves (each head's gate beside its query), against torch's
three-op path (a copy of the gate, sigmoid, the multiply); and the dispatch (layers/
activation.sigmoid_gate) keeping torch's path for CPU tensors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shoal.layers.activation import sigmoid_gate  # noqa: E402
from shoal.layers.ops.sigmoid_gate import sigmoid_gate as fused  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# sigmoid's exp may differ from torch's by an ulp of float32; in a half dtype that moves the
# rounded sigmoid by an ulp at a near tie, and the product's rounding by one more
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-7), torch.bfloat16: dict(rtol=2 ** -6, atol=0),
       torch.float16: dict(rtol=2 ** -9, atol=0)}


def _views(t: int, heads: int, d: int, dtype: torch.dtype):
    """o [T, H, D] contiguous and the gate as the q projection leaves it: [T, H, 2D] rows
    (query, gate) and more columns after (k, v), split."""
    g = torch.Generator().manual_seed(t * 100 + heads)
    qkv = (3 * torch.randn(t, heads * 2 * d + 2 * d, generator=g)).to(DEV, dtype)
    gate = qkv[:, :heads * 2 * d].view(t, heads, 2 * d)[..., d:]
    o = torch.randn(t, heads, d, generator=g).to(DEV, dtype)
    return o, gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,heads,d", [(1, 4, 16), (3, 6, 32), (5, 3, 8)])
def test_fused_gate_is_torchs(t: int, heads: int, d: int, dtype: torch.dtype) -> None:
    o, gate = _views(t, heads, d, dtype)
    assert not gate.is_contiguous()
    got = fused(o, gate)
    want = o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
    assert got.shape == (t, heads * d) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_no_tokens_and_bad_inputs() -> None:
    o, gate = _views(1, 2, 8, torch.float32)
    assert fused(o[:0], gate[:0]).shape == (0, 16)
    with pytest.raises(ValueError, match="one dtype"):
        fused(o, gate.to(torch.bfloat16))
    with pytest.raises(ValueError, match="power of two"):
        fused(o[..., :6].contiguous(), gate[..., :6])


def test_cpu_tensors_keep_torchs_path_bit_for_bit() -> None:
    o, gate = _views(3, 4, 16, torch.bfloat16)
    o, gate = o.cpu(), gate.cpu()
    want = o.reshape(3, -1) * torch.sigmoid(gate.reshape(3, -1))
    assert torch.equal(sigmoid_gate(o, gate), want)
    assert torch.equal(sigmoid_gate(o.reshape(3, -1), gate), want)  # o flat, as some backends


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused launch takes CUDA tensors")
def test_cuda_tensors_take_the_fused_launch(monkeypatch) -> None:
    from shoal.layers.ops import sigmoid_gate as op

    calls = []
    real = op.sigmoid_gate
    monkeypatch.setattr(op, "sigmoid_gate", lambda o, g: calls.append(1) or real(o, g))
    o, gate = _views(2, 4, 16, torch.bfloat16)
    want = o.reshape(2, -1) * torch.sigmoid(gate.reshape(2, -1))
    torch.testing.assert_close(sigmoid_gate(o.reshape(2, -1), gate), want, **TOL[torch.bfloat16])
    assert calls == [1]
    odd_o, odd_gate = _views(2, 4, 12, torch.bfloat16)  # head dim 12: torch's path
    sigmoid_gate(odd_o, odd_gate)
    assert calls == [1]

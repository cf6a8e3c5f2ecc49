"""FusedMoE with per-expert biases and gpt-oss's clamped SwiGLU (activation.py): the PyTorch
expert loop against a token-by-token float64 definition, the Triton kernel (the interpreter
on the CPU, see conftest.py) and the capture-safe dense path against the loop, and the bias
loading and tensor-parallel rule (the down bias added by one rank)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shoal.layers.moe.activation import SILU, ExpertActivation  # noqa: E402
from shoal.layers.moe.layer import FusedMoE  # noqa: E402
from shoal.layers.moe.router import select_experts  # noqa: E402
from shoal.layers.moe.torch_experts import experts_dense, experts_torch  # noqa: E402
from shoal.layers.moe.triton_experts import experts_triton  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CLAMPED = ExpertActivation("clamped_swiglu", alpha=1.702, limit=1.0)


def make(t: int, e: int, k: int, h: int, inter: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    b13, b2 = torch.randn(e, 2 * inter, generator=g), torch.randn(e, h, generator=g)
    weights, ids = select_experts(torch.randn(t, e, generator=g) * 2, k, renormalize=True)
    return x, w13, w2, b13, b2, weights, ids


def definition(x, w13, w2, b13, b2, weights, ids, alpha: float, limit: float) -> torch.Tensor:
    """Token by token in float64, as transformers' GptOssExperts reads (gate and up here
    already split into halves)."""
    x, w13, w2, b13, b2, weights = (a.double() for a in (x, w13, w2, b13, b2, weights))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (w13[e] @ x[t] + b13[e]).chunk(2)
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[t] += weights[t, j] * (w2[e] @ act + b2[e])
    return out


def test_activation_kinds() -> None:
    gu = torch.randn(3, 8) * 4
    gate, up = gu.chunk(2, -1)
    torch.testing.assert_close(SILU(gu), torch.nn.functional.silu(gate) * up)
    assert CLAMPED(gu).shape == (3, 4)
    with pytest.raises(ValueError, match="expert activation"):
        ExpertActivation("gelu")


def test_torch_loop_matches_the_definition() -> None:
    x, w13, w2, b13, b2, weights, ids = make(11, 4, 2, 32, 16, seed=0)
    got = experts_torch(x, w13, w2, weights, ids, b13, b2, CLAMPED)
    torch.testing.assert_close(got.double(), definition(x, w13, w2, b13, b2, weights, ids,
                                                         1.702, 1.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", [SILU, CLAMPED], ids=["silu", "clamped"])
def test_triton_and_dense_match_the_loop(act: ExpertActivation) -> None:
    x, w13, w2, b13, b2, weights, ids = make(13, 4, 2, 64, 32, seed=1)
    want = experts_torch(x, w13, w2, weights, ids, b13, b2, act)
    got = experts_triton(*(a.to(DEV) for a in (x, w13, w2, weights, ids, b13, b2)),
                         activation=act)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    dense = experts_dense(x, w13, w2, weights, ids, b13, b2, act)
    torch.testing.assert_close(dense, want, atol=2e-5, rtol=2e-5)


def test_triton_rejects_misshapen_biases() -> None:
    x, w13, w2, b13, b2, weights, ids = make(4, 4, 2, 64, 32, seed=2)
    with pytest.raises(ValueError, match="expert bias"):
        experts_triton(x, w13, w2, weights, ids, b13[:, :8], b2)


def test_biases_load_and_the_down_bias_is_added_once_under_tp() -> None:
    x, w13, w2, b13, b2, weights, ids = make(5, 4, 2, 32, 16, seed=3)
    moe = FusedMoE(4, 32, 16, params_dtype=torch.float32, has_bias=True, activation=CLAMPED)
    for e in range(4):
        gate, up = w13[e].chunk(2)
        gate_b, up_b = b13[e].chunk(2)
        for shard, w, b in (("w1", gate, gate_b), ("w3", up, up_b)):
            moe.weight_loader(moe.w13_weight, w, e, shard)
            moe.weight_loader(moe.w13_bias, b, e, shard)
        moe.weight_loader(moe.w2_weight, w2[e], e, "w2")
        moe.weight_loader(moe.w2_bias, b2[e], e, "w2")
    assert torch.equal(moe.w13_bias, b13) and torch.equal(moe.w2_bias, b2)
    want = experts_torch(x, w13, w2, weights, ids, b13, b2, CLAMPED)
    torch.testing.assert_close(moe(x, weights, ids), want)
    # A second tensor-parallel rank adds no down bias: rank 0 alone does before the sum.
    moe.adds_down_bias = False
    torch.testing.assert_close(moe(x, weights, ids),
                               experts_torch(x, w13, w2, weights, ids, b13, None, CLAMPED))

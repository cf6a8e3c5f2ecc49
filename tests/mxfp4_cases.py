"""Packed MXFP4 experts for the MXFP4 expert tests (tests/layers/test_mxfp4_moe.py,
test_mxfp4_decode_experts.py, test_mxfp4_decode_words.py), each at its own shape: random
experts holding every e2m1 code, a routing, gpt-oss's biases, and the two checks both decode
forms (tiles and words) run against the dequantized weights' PyTorch twin."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.layers.moe.activation import ExpertActivation
from shoal.layers.moe.mxfp4_experts import Mxfp4Experts, Mxfp4Weights, mxfp4_weights
from shoal.layers.moe.router import select_experts
from shoal.layers.moe.triton_experts_mxfp4 import experts_mxfp4_reference

CLAMPED = ExpertActivation("clamped_swiglu", alpha=1.702, limit=1.0)  # limits the data reaches
# A decode form: (x, experts, topk_weights, topk_ids, **biases and activation) -> [T, H]
Run = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ExpertsShape:
    e: int
    top_k: int
    h: int
    inter: int
    device: torch.device

    def packed_experts(self, seed: int, low: int = 121, high: int = 125) -> Mxfp4Experts:
        """Every e2m1 code; scales 2^(low - 127) .. 2^(high - 128)."""
        g = torch.Generator().manual_seed(seed)

        def one(n: int, k: int) -> Mxfp4Weights:
            blocks = torch.randint(0, 256, (self.e, n, k // 32, 16), dtype=torch.uint8,
                                   generator=g)
            scales = torch.randint(low, high, (self.e, n, k // 32), dtype=torch.uint8,
                                   generator=g)
            w = mxfp4_weights(blocks, scales)
            return Mxfp4Weights(w.blocks.to(self.device), w.scales.to(self.device))

        return Mxfp4Experts(one(2 * self.inter, self.h), one(self.h, self.inter))

    def routed(self, t: int, seed: int, dtype: torch.dtype = torch.float32,
               ids: torch.Tensor | None = None, device: torch.device | None = None
               ) -> tuple[torch.Tensor, ...]:
        """x [t, H] and a softmax top-k routing (or `ids` with random weights), on `device`
        (default the shape's)."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(t, self.h, generator=g)
        if ids is None:
            weights, ids = select_experts(torch.randn(t, self.e, generator=g) * 2, self.top_k,
                                          True)
        else:
            weights = torch.rand(ids.shape, generator=g) + 0.1
        dev = self.device if device is None else device
        return x.to(dev, dtype), weights.to(dev, dtype), ids.to(dev)

    def biases(self, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return dict(
            w13_bias=(torch.randn(self.e, 2 * self.inter, generator=g) * 0.3).to(
                self.device, dtype),
            w2_bias=(torch.randn(self.e, self.h, generator=g) * 0.3).to(self.device, dtype))


def check_against_the_twin(run: Run, shape: ExpertsShape, dtype: torch.dtype,
                           gpt_oss_mlp: bool, t: int) -> None:
    """float32: the PyTorch twin to 1e-5 of the largest output (the summation order
    differs). Half precision: the twin rounds each op of the activation and each pair's
    down row to x's dtype, the kernels only gate / up and the activation's result and the
    token's sum: four units in the last place bound the norm of the difference."""
    q = shape.packed_experts(seed=1)
    x, weights, ids = shape.routed(t, seed=2, dtype=dtype)
    extra = dict(shape.biases(3, dtype), activation=CLAMPED) if gpt_oss_mlp else {}
    got = run(x, q, weights, ids, **extra)
    assert got.dtype == dtype and got.shape == (t, shape.h)
    want = experts_mxfp4_reference(x, q, weights, ids, **extra).float()
    if dtype == torch.float32:
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), err
        return
    ulp = {torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}[dtype]
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 4 * ulp, rel


def check_wide_scales_and_foreign_pairs(run: Run, shape: ExpertsShape) -> None:
    """Scales 2^-27 .. 2^22 (the exponent field's use, not just its low bits), and a pair
    run as expert 0 with routing weight 0 (another expert-parallel rank's) adding nothing:
    not even its bias."""
    q = shape.packed_experts(seed=4, low=100, high=150)
    x, weights, ids = shape.routed(2, seed=5)
    weights[1, 0] = 0.0
    extra = dict(shape.biases(6, torch.float32), activation=ExpertActivation())
    got = run(x, q, weights, ids, **extra)
    want = experts_mxfp4_reference(x, q, weights, ids, **extra)
    assert ((got - want).norm() / want.norm()).item() < 1e-6
    alone = run(x[1:], q, weights[1:, 1:], ids[1:, 1:], **extra)
    assert ((got[1:] - alone).norm() / alone.norm()).item() < 1e-6

"""DeepSeek-V4's hyper-connection mixes in one Triton kernel (layers/ops/hyper_connection_mix.py)
against the layer's PyTorch form (interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shoal.layers.hyper_connection import HyperConnection
from shoal.layers.ops.hyper_connection_mix import hc_mix

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("hc,iters,tokens", [(4, 20, 5), (3, 2, 3), (4, 1, 1)])
def test_the_kernel_is_the_layers_mixes(hc, iters, tokens) -> None:
    """hc 3 exercises the masked lanes of a power-of-two block; iters 1 the columns alone."""
    g = torch.Generator().manual_seed(hc * 100 + iters)
    cfg = SimpleNamespace(hc_mult=hc, hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-6,
                          hidden_size=8)
    layer = HyperConnection(cfg, use_triton_ops=False)
    m = (2 + hc) * hc
    layer.base.data = torch.randn(m, generator=g)
    layer.scale.data = torch.rand(3, generator=g) + 0.5
    mixes = torch.randn(tokens, m, generator=g) * 3
    want = layer.mix(mixes)
    got = hc_mix(mixes.to(DEV), layer.base.to(DEV), layer.scale.to(DEV), hc, iters, 1e-6)
    for name, w, x in zip(("pre", "post", "comb"), want, got):
        torch.testing.assert_close(x.cpu(), w, rtol=1e-5, atol=1e-6, msg=name)
    comb = got[2].cpu()
    if iters > 1:  # doubly stochastic, up to the iterations' convergence
        torch.testing.assert_close(comb.sum(-2), torch.ones(tokens, hc), atol=1e-5, rtol=0)


def test_bad_mixes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"float32 \[T, 24\]"):
        hc_mix(torch.zeros(2, 20), torch.zeros(24), torch.ones(3), 4, 20, 1e-6)
    with pytest.raises(ValueError, match="hc_sinkhorn_iters must be >= 1"):
        hc_mix(torch.zeros(2, 24), torch.zeros(24), torch.ones(3), 4, 0, 1e-6)

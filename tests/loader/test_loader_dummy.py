from __future__ import annotations

import torch

from shoal.loader import initialize_dummy_weights


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 16),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 8, bias=True),
    )


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_fills_every_parameter_in_range():
    model = _model()
    initialize_dummy_weights(model, seed=0, low=-0.01, high=0.01)
    for name, param in model.named_parameters():
        assert param.abs().max() <= 0.01, name
        assert param.std() > 0, name  # replaced, not left at the init's constant ones/zeros


def test_deterministic_per_seed():
    a, b, c = _model(), _model(), _model()
    initialize_dummy_weights(a, seed=3)
    initialize_dummy_weights(b, seed=3)
    initialize_dummy_weights(c, seed=4)
    pa, pb, pc = _params(a), _params(b), _params(c)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not all(torch.equal(pa[n], pc[n]) for n in pa)


def test_default_range_is_small():
    model = _model()
    initialize_dummy_weights(model)
    assert max(p.abs().max().item() for p in model.parameters()) <= 1e-3


def test_half_precision_parameters():
    model = _model().to(torch.bfloat16)
    initialize_dummy_weights(model, seed=1)
    assert all(p.dtype == torch.bfloat16 and p.abs().max() <= 1e-3 for p in model.parameters())

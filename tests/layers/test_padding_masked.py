"""A padded chunk of the delta rule (linear_attention.padding_masked, the hybrid prefill
graphs' padding) leaves the state and real outputs of its real tokens, even when a padding
row holds NaN or Inf: its attention read cache slots past the real tokens, which may hold an
earlier linear state's float32 words, non-finite as bf16."""

from __future__ import annotations

import pytest
import torch

from shoal.layers.linear_attention import padding_masked
from shoal.layers.ops.gated_delta_rule import chunk_gated_delta_rule


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("kda", [False, True])
def test_poisoned_padding_leaves_the_real_tokens_state(poison, kda) -> None:
    g = torch.Generator().manual_seed(3)
    real_n, padded_n, h, dk, dv = 5, 16, 2, 8, 8
    q = torch.nn.functional.normalize(torch.randn(padded_n, h, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(padded_n, h, dk, generator=g), dim=-1)
    v = torch.randn(padded_n, h, dv, generator=g)
    decay = (padded_n, h, dk) if kda else (padded_n, h)
    log_g = -torch.rand(*decay, generator=g) * 0.3
    beta = torch.rand(padded_n, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g) * 0.1
    for x in (q, k, v, log_g):  # the padding rows' values, as a stale cache could give
        x[real_n + 2] = poison
    want_o, want_state, _ = chunk_gated_delta_rule(
        q[:real_n], k[:real_n], v[:real_n], log_g[:real_n], beta[:real_n], state, scale=0.5)
    real = torch.arange(padded_n) < real_n
    heads = padding_masked((q, k, v, log_g, beta), real)
    got_o, got_state, _ = chunk_gated_delta_rule(*heads, state, scale=0.5)
    assert torch.isfinite(got_state).all()
    torch.testing.assert_close(got_state, want_state)
    torch.testing.assert_close(got_o[:real_n], want_o)
    assert padding_masked((q,), None)[0] is q  # every token real: untouched

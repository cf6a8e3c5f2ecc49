"""fla-core's chunked kernels (layers/ops/fla_chunk.py, the CUDA prefill path of linear
attention) against shoal's torch chunked rule (gated_delta_rule.py), for Gated DeltaNet
(Qwen3.5's heads: 16 key heads grouped over 48 value heads) and KDA (Kimi-Linear's per-channel
decay), from a non-zero state; and their times at 128 and 4,096 tokens. Needs CUDA and
fla-core (carried as a wheel on the GPU machine: fla-core==0.6.0 and einops)."""

from __future__ import annotations

import time

import pytest
import torch

from shoal.layers.linear_attention import l2_normed
from shoal.layers.ops import fla_chunk
from shoal.layers.ops.gated_delta_rule import chunk_gated_delta_rule

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or fla_chunk._kernels() is None,
    reason="needs CUDA and fla-core")

SHAPES = {"gdn": dict(hk=16, h=48, dk=128, dv=128), "kda": dict(hk=32, h=32, dk=128, dv=128)}


def _inputs(kind: str, tokens: int, seed: int):
    s = SHAPES[kind]
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    q = randn(tokens, s["hk"], s["dk"]).bfloat16()
    k = randn(tokens, s["hk"], s["dk"]).bfloat16()
    v = randn(tokens, s["h"], s["dv"]).bfloat16()
    decay_shape = (tokens, s["h"]) if kind == "gdn" else (tokens, s["h"], s["dk"])
    log_decay = -torch.rand(*decay_shape, generator=g, device="cuda") * 0.2  # float32, < 0
    beta = torch.rand(tokens, s["h"], generator=g, device="cuda").sigmoid()
    state = randn(s["h"], s["dk"], s["dv"]) * 0.05
    return q, k, v, log_decay, beta, state


def _torch_rule(q, k, v, log_decay, beta, state, scale):
    r = v.shape[1] // q.shape[1]
    qn = l2_normed(q).repeat_interleave(r, dim=1)
    kn = l2_normed(k).repeat_interleave(r, dim=1)
    o, final, _ = chunk_gated_delta_rule(qn, kn, v.float(), log_decay, beta, state,
                                         scale=scale)
    return o, final


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("tokens", [1, 100, 300])
def test_fla_gives_the_torch_rule(kind, tokens) -> None:
    q, k, v, log_decay, beta, state = _inputs(kind, tokens, seed=tokens)
    scale = q.shape[-1] ** -0.5
    got_o, got_state = fla_chunk.chunk_rule(q, k, v, log_decay, beta, state.clone(), scale)
    want_o, want_state = _torch_rule(q, k, v, log_decay, beta, state, scale)
    assert got_o.shape == want_o.shape and got_state.shape == want_state.shape
    # bf16 operands inside fla's kernels: a few bf16 ulps of the outputs' scale
    for got, want in ((got_o, want_o), (got_state.float(), want_state)):
        err = (got - want).abs().max().item()
        assert err <= 2e-2 * max(1.0, want.abs().max().item()), (kind, tokens, err)


def test_fla_and_torch_rule_times() -> None:
    """Printed (CUDA events, median of 5 after a warm-up), not asserted: the kernels' own
    timings against the torch rule, for the result files."""
    for kind in ("gdn", "kda"):
        for tokens in (128, 4096):
            args = _inputs(kind, tokens, seed=1)
            args = (*args, args[0].shape[-1] ** -0.5)
            for name, rule in (("fla", fla_chunk.chunk_rule), ("torch", _torch_rule)):
                rule(*args)
                times = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    rule(*args)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                times.sort()
                print(f"{kind} T={tokens} {name}: {times[2] * 1e3:.3f} ms a layer")

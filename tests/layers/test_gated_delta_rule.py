"""The gated delta rule ops (Gated DeltaNet's per-head decay, KDA's per-channel decay) and the
causal conv1d against transformers' PyTorch references (Qwen3-Next, Kimi Linear) and against a
token-by-token loop of recurrent_gated_delta_rule: initial states, ragged chunks, absolute-position
chunk alignment with saved states, strongly negative gates and carrying state across calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen  # noqa: E402

from shoal.layers.ops.gated_delta_rule import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

H, DK, DV = 2, 8, 6
SCALE = DK**-0.5  # transformers' fixed query scale, for GDN and KDA alike


def _inputs(T: int, kda: bool, seed: int = 0, g_min: float = -1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(T, H, DK, generator=gen), dim=-1) for _ in range(2))
    g_shape = (T, H, DK) if kda else (T, H)
    return {
        "q": q, "k": k, "v": torch.randn(T, H, DV, generator=gen),
        "g": g_min * torch.rand(g_shape, generator=gen),
        "beta": torch.rand(T, H, generator=gen),
        "state": torch.randn(H, DK, DV, generator=gen),
    }


def _loop(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Token by token with the one-token op: outputs [T, H, Dv] and the state after each."""
    state, outs, states = x["state"][None], [], []
    for t in range(x["q"].shape[0]):
        step = {n: x[n][t:t + 1] for n in ("q", "k", "v", "g", "beta")}
        o, state = recurrent_gated_delta_rule(**step, state=state, scale=SCALE)
        outs.append(o[0])
        states.append(state[0])
    return torch.stack(outs), states


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()))


def _hf(x: dict[str, torch.Tensor], kda: bool, chunk: int | None) -> tuple[torch.Tensor, ...]:
    """transformers' chunked (chunk set) or recurrent reference, batch of one, q/k pre-normed."""
    args = [x[n][None] for n in ("q", "k", "v", "g", "beta")]
    kw = {"initial_state": x["state"][None], "output_final_state": True,
          "use_qk_l2norm_in_kernel": False}
    if chunk is None:
        fn = hf_kimi.recurrent_kimi_delta_attention if kda else hf_qwen.torch_recurrent_gated_delta_rule
    else:
        fn = hf_kimi.chunk_kimi_delta_attention if kda else hf_qwen.torch_chunk_gated_delta_rule
        kw["chunk_size"] = chunk
    o, state = fn(*args, **kw)
    return o[0], state[0]


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("T,chunk", [(1, 16), (37, 16), (70, 64), (300, 16)])  # 300: > 16 chunks
def test_chunk_matches_references(kda: bool, T: int, chunk: int) -> None:
    x = _inputs(T, kda, seed=T)
    o, state, saved = chunk_gated_delta_rule(**x, scale=SCALE, chunk_size=chunk)
    assert saved == [] and o.dtype == torch.float32 and o.shape == (T, H, DV)
    o_loop, states = _loop(x)
    _close(o, o_loop)
    _close(state, states[-1])
    for ref_chunk in (chunk, None):
        o_hf, state_hf = _hf(x, kda, ref_chunk)
        _close(o, o_hf)
        _close(state, state_hf)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_strongly_negative_gates(kda: bool) -> None:
    """g = -20 per token (exp(-1280) over a chunk of 64), mixed with channels/heads near 0."""
    x = _inputs(100, kda, seed=1)
    x["g"][..., 0] = -20.0  # KDA: key channel 0 of every head; GDN: head 0
    x["g"][40:45] = -20.0
    o, state, _ = chunk_gated_delta_rule(**x, scale=SCALE, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    o_loop, states = _loop(x)
    _close(o, o_loop)
    _close(state, states[-1])
    _close(o, _hf(x, kda, 64)[0])


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_offset_saves_chunk_end_states(kda: bool) -> None:
    offset, T, chunk, every = 13, 90, 16, 32
    x = _inputs(T, kda, seed=2)
    o, state, saved = chunk_gated_delta_rule(**x, scale=SCALE, chunk_size=chunk,
                                             offset=offset, save_every=every)
    o_loop, states = _loop(x)
    _close(o, o_loop)
    _close(state, states[-1])
    at = [i for i in range(T) if (offset + i + 1) % every == 0]
    assert at == [18, 50, 82] and len(saved) == len(at)
    for i, s in zip(at, saved, strict=True):
        _close(s, states[i])
    with pytest.raises(AssertionError):
        chunk_gated_delta_rule(**x, scale=SCALE, chunk_size=chunk, save_every=24)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_split_carrying_state_equals_one_call(kda: bool) -> None:
    x = _inputs(75, kda, seed=3)
    o, state, saved = chunk_gated_delta_rule(**x, scale=SCALE, chunk_size=16, save_every=16)
    state_in, outs, saved_parts = x["state"], [], []
    for lo, hi in ((0, 21), (21, 22), (22, 75)):
        part = {n: x[n][lo:hi] for n in ("q", "k", "v", "g", "beta")}
        o_p, state_in, s_p = chunk_gated_delta_rule(**part, state=state_in, scale=SCALE,
                                                    chunk_size=16, offset=lo, save_every=16)
        outs.append(o_p)
        saved_parts += s_p
    _close(torch.cat(outs), o)
    _close(state_in, state)
    assert len(saved) == len(saved_parts) == 4
    for a, b in zip(saved_parts, saved, strict=True):
        _close(a, b)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_recurrent_batch_matches_transformers(kda: bool) -> None:
    B = 3
    xs = [_inputs(1, kda, seed=10 + b) for b in range(B)]
    x = {n: torch.cat([xi[n] for xi in xs]) if n != "state" else torch.stack([xi[n] for xi in xs])
         for n in xs[0]}
    o, state = recurrent_gated_delta_rule(**x, scale=SCALE)
    for b, xb in enumerate(xs):
        o_hf, state_hf = _hf(xb, kda, None)
        _close(o[b], o_hf[0])
        _close(state[b], state_hf)


def test_empty_sequence() -> None:
    x = _inputs(0, kda=True)
    o, state, saved = chunk_gated_delta_rule(**x, scale=SCALE, offset=5, save_every=64)
    assert o.shape == (0, H, DV) and saved == []
    torch.testing.assert_close(state, x["state"])


@pytest.mark.parametrize("bias", [False, True])
def test_causal_conv1d_matches_transformers(bias: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    T, C, K = 11, 5, 4
    x = torch.randn(T, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    b = torch.randn(C, generator=gen) if bias else None
    ref = hf_qwen.causal_conv1d_fn(x.t()[None], w, b, activation="silu")[0].t()
    out, state = causal_conv1d(x, w, b, torch.zeros(C, K - 1))
    _close(out, ref)
    torch.testing.assert_close(state, x[-(K - 1):].t())
    # The same sequence in pieces, some shorter than K-1, carrying the conv state.
    state, outs = torch.zeros(C, K - 1), []
    for lo, hi in ((0, 2), (2, 3), (3, 8), (8, 9), (9, 11)):
        o, state = causal_conv1d(x[lo:hi], w, b, state)
        outs.append(o)
    _close(torch.cat(outs), ref)
    torch.testing.assert_close(state, x[-(K - 1):].t())
    # One token per sequence for a batch, against transformers' in-place update.
    conv_state = torch.randn(3, C, K - 1, generator=gen)
    xt = torch.randn(3, C, generator=gen)
    hf_state = conv_state.clone()
    ref = hf_qwen.causal_conv1d_update(xt[..., None], hf_state, w, b, activation="silu")[..., 0]
    out, new_state = causal_conv1d_step(xt, w, b, conv_state)
    _close(out, ref)
    torch.testing.assert_close(new_state, hf_state)
    # The step agrees with the sequence op for the same token.
    out_seq, state_seq = causal_conv1d(xt[:1], w, b, conv_state[0])
    _close(out[:1], out_seq)
    torch.testing.assert_close(new_state[0], state_seq)

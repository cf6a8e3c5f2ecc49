"""The in-place decode kernels of linear attention (shoal/layers/ops/linear_state_decode.py)
under TRITON_INTERPRET=1 against the torch ops: states read from one block and written to
another inside the pages of a [planes, slots, Hk, D] cache (a state straddling both
planes), the conv window moved on, per-head (Gated DeltaNet) and per-channel (KDA) decay,
key heads shared by several value heads."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from shoal.attention.linear_state import StatePages  # noqa: E402
from shoal.layers.linear_attention import l2_normed  # noqa: E402
from shoal.layers.ops import linear_state_decode as kernels  # noqa: E402
from shoal.layers.ops.gated_delta_rule import (  # noqa: E402
    causal_conv1d_step,
    recurrent_gated_delta_rule,
)

BS, PLANES, HK_PAGE, D_PAGE = 16, 2, 2, 16  # a page of 2 x 16 x 2 x 16 float32 = 4 KiB


# kw 3: the conv kernel's taps padded to a power of two (shipped models have 4); early: the
# conv windows read before the kernel's wait (the same result: PDL is off here, so this runs
# the code of both orders for the sm_90 compile check, tests/sm90_compile.py)
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("per_channel, nk, nv, kw", [(False, 1, 2, 4), (True, 2, 2, 4),
                                                     (False, 1, 2, 3)])
def test_kernels_match_the_torch_step(per_channel: bool, nk: int, nv: int, kw: int,
                                      early: bool):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dk = dv = 16
    c = 2 * nk * dk + nv * dv
    cache = torch.zeros(PLANES, 6 * BS, HK_PAGE, D_PAGE, device=device)
    pages = StatePages(cache, BS, (c, kw - 1), (nv, dk, dv))
    assert len(pages.runs) == 2  # the state spills into the second plane
    read = torch.tensor([1, 3, 4], device=device)
    write = torch.tensor([2, 3, 5], device=device)  # row 0 crosses into a new block
    conv0, state0 = torch.randn(3, c, kw - 1), torch.randn(3, nv, dk, dv) * 0.3
    pages.write(read, conv0.to(device), state0.to(device))
    b = 3
    x = torch.randn(b, c, device=device)
    weight, bias = torch.randn(c, kw, device=device), torch.randn(c, device=device)
    g = -torch.rand(b, nv, dk, device=device) if per_channel else -torch.rand(b, nv, device=device)
    beta = torch.rand(b, nv, device=device)

    y_ref, conv_ref = causal_conv1d_step(x.cpu(), weight.cpu(), bias.cpu(), conv0)
    q, k, v = y_ref.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q, k = (l2_normed(t.reshape(b, nk, dk)).repeat_interleave(nv // nk, 1) for t in (q, k))
    o_ref, state_ref = recurrent_gated_delta_rule(q, k, v.reshape(b, nv, dv), g.cpu(),
                                                  beta.cpu(), state0, scale=dk ** -0.5)

    words = pages.words
    pw = kernels.PageWords(words, words.shape[2], words.stride(0), words.stride(1))
    y = kernels.conv_step(x, weight, bias, pw, read, write, early_states=early)
    torch.testing.assert_close(y.cpu(), y_ref, atol=1e-5, rtol=1e-5)
    qy, ky, vy = y.split([nk * dk, nk * dk, nv * dv], dim=-1)
    o = kernels.delta_rule_step(qy.reshape(b, nk, dk), ky.reshape(b, nk, dk),
                                vy.reshape(b, nv, dv), g, beta, pw, pages.conv_words, read,
                                write, dk ** -0.5)
    torch.testing.assert_close(o.cpu(), o_ref, atol=1e-5, rtol=1e-5)
    conv, state = pages.read(write)
    torch.testing.assert_close(conv.cpu(), conv_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state.cpu(), state_ref, atol=1e-5, rtol=1e-5)
    # the block row 0 read from keeps its state (a cached prefix's snapshot)
    torch.testing.assert_close(pages.read(read[:1])[1].cpu(), state0[:1])

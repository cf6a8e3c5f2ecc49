"""The gated delta rule over rows of a few tokens each, at fixed shapes: what a CUDA graph of a
speculative verify step runs (each row a request's last token and its drafts, padded to q)
and what folding a verify's accepted run into a state runs (shoal/layers/linear_attention.py).

Each row has `counts[r]` real tokens, a prefix of its T; the rest are padding. Nothing here
reads a value back to the host or branches on one: padding tokens enter the recurrence as
identity steps (k = v = 0, g = 0, beta = 0 leave the state exactly as it was, whatever the
padding held), and the conv state after a row's real tokens is gathered by its count.
Short rows (T <= 9 in practice) run the recurrent form token by token, batched over rows:
in one Triton kernel on CUDA (delta_rule_rows_triton.py), in torch ops elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from shoal.layers.ops.dispatch import use_triton
from shoal.layers.ops.gated_delta_rule import recurrent_gated_delta_rule


def real_tokens(counts: Tensor, T: int) -> Tensor:
    """[R, T] bool: token t of row r is real (t < counts[r])."""
    return torch.arange(T, device=counts.device) < counts.unsqueeze(-1)


def causal_conv1d_rows(x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor,
                       counts: Tensor | None) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv + SiLU of R rows: x [R, T, C]; weight [C, K]; conv_state
    [R, C, K-1], the K-1 inputs before each row; counts [R] real tokens per row (None: all
    T). Returns (out [R, T, C] in x's dtype: a real token's output sees only the row's
    conv state and real tokens before it; the conv state after each row's real tokens
    [R, C, K-1], in conv_state's dtype)."""
    R, T, C = x.shape
    K = weight.shape[1]
    xs = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [R, C, K-1+T]
    out = F.conv1d(xs.float(), weight.float().unsqueeze(1),
                   None if bias is None else bias.float(), groups=C)  # [R, C, T]
    if counts is None:
        end = xs[:, :, T:]
    else:  # the K-1 inputs ending at each row's last real token
        at = counts.view(R, 1, 1) + torch.arange(K - 1, device=x.device).view(1, 1, K - 1)
        end = xs.gather(-1, at.expand(R, C, K - 1))
    return F.silu(out).transpose(1, 2).to(x.dtype), end.to(conv_state.dtype)


def gated_delta_rule_rows(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                          state: Tensor, counts: Tensor | None, *, scale: float
                          ) -> tuple[Tensor, Tensor]:
    """R rows of T tokens: q, k [R, T, H, Dk] (normed, repeated to v's heads); v [R, T, H, Dv];
    g [R, T, H] or [R, T, H, Dk]; beta [R, T, H]; state [R, H, Dk, Dv], each row's state
    before its first token; counts [R] (None: all T real). Returns (o [R, T, H, Dv] float32,
    padding tokens' outputs unspecified; each row's state after its real tokens). CUDA
    tensors go through one Triton kernel (delta_rule_rows_triton.py), others the torch ops."""
    if use_triton(q, True):
        from shoal.layers.ops.delta_rule_rows_triton import gated_delta_rule_rows_triton
        return gated_delta_rule_rows_triton(q, k, v, g, beta, state, counts, scale=scale)
    return gated_delta_rule_rows_torch(q, k, v, g, beta, state, counts, scale=scale)


def gated_delta_rule_rows_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                state: Tensor, counts: Tensor | None, *, scale: float
                                ) -> tuple[Tensor, Tensor]:
    """gated_delta_rule_rows token by token in torch ops (the reference; the CPU path)."""
    T = q.shape[1]
    if counts is not None:
        real = real_tokens(counts, T)

        def masked(t: Tensor) -> Tensor:
            m = real.view(*real.shape, *([1] * (t.dim() - 2)))
            return torch.where(m, t.float(), 0.0)
        k, v, g, beta = masked(k), masked(v), masked(g), masked(beta)
    state = state.float()
    outs = []
    for t in range(T):
        o, state = recurrent_gated_delta_rule(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t],
                                              state, scale=scale)
        outs.append(o)
    return torch.stack(outs, dim=1), state

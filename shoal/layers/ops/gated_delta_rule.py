"""PyTorch reference ops of the linear-attention layers: the gated delta rule of Gated DeltaNet
(Qwen3-Next / Qwen3.5: one log-decay per head) and of Kimi Delta Attention (Kimi Linear: one
log-decay per key channel), plus the depthwise causal conv1d + SiLU in front of them.

Per head and token t, with S [Dk, Dv] and g_t <= 0 (a scalar, or a vector over Dk for KDA):
    S = diag(exp(g_t)) S;  S = S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = scale q_t^T S.
The decay applies before the update for both variants, as in transformers' references
(torch_*_gated_delta_rule, *_kimi_delta_attention). Callers l2-normalise q and k and repeat
k-heads to v-heads; every op takes one request's tensors and computes in float32."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

# Chunks whose intra-chunk tensors are built at once: bounds memory for long prompts.
_CHUNKS_PER_SEGMENT = 16


def _decayed_gram(x: Tensor, y: Tensor, G: Tensor, sub: int) -> Tensor:
    """A[..., a, b] = sum_d x_a[d] y_b[d] exp(G_a[d] - G_b[d]) for b <= a, 0 above the diagonal.

    y, G [..., C, D] and x [..., C, D] or [X, ..., C, D] (X left-hand sides sharing y's decayed
    terms); G is the within-chunk cumulative log-decay (non-increasing), with D = 1 for a per-head
    decay. Every exponent taken is <= 0, so nothing overflows for any g."""
    C = x.shape[-2]
    if G.shape[-1] == 1:  # one decay per head: the pairwise decay factors out of the dot product
        diff = (G - G.transpose(-1, -2)).masked_fill(_upper(C, 1, G.device), -math.inf)
        return (x @ y.transpose(-1, -2)) * diff.exp()
    # Per-channel decay does not factor as exp(G_a) exp(-G_b) without overflow over a chunk, so
    # split it into sub-chunks I: pairs b < start(I) <= a go through the reference point
    # r_I = G[start(I)] as exp(G_a - r_I) exp(r_I - G_b), both factors <= 1 (a matmul);
    # pairs inside I take the pairwise per-channel decays directly (sub x sub x D only).
    n = C // sub
    xs, ys, Gs = (t.unflatten(-2, (n, sub)) for t in (x, y, G))  # [..., n, sub, D]
    ref = Gs[..., :1, :]  # [..., n, 1, D]
    xq = xs * (Gs - ref).exp()
    before = torch.arange(C, device=x.device) < torch.arange(0, C, sub, device=x.device)[:, None]
    e = (ref - G.unsqueeze(-3)).masked_fill(~before[..., None], -math.inf)  # [..., n, C, D]
    out = (xq @ (y.unsqueeze(-3) * e.exp()).transpose(-1, -2)).unflatten(-1, (n, sub))
    pair = (Gs.unsqueeze(-2) - Gs.unsqueeze(-3)).masked_fill(_upper(sub, 1, x.device)[..., None],
                                                             -math.inf)
    y_pair = ys.unsqueeze(-3) * pair.exp()  # [..., n, sub(a), sub(b), D]
    diag = (y_pair @ xs.unsqueeze(-1)).squeeze(-1)  # [..., n, sub, sub]
    # out [..., n, sub, n, sub]: its diagonal blocks (I, I) are still zero; write them in place.
    torch.diagonal(out, dim1=-4, dim2=-2).copy_(diag.movedim(-3, -1))
    return out.flatten(-2).flatten(-3, -2)


def _upper(n: int, diagonal: int, device: torch.device) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(diagonal)


def _scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, scale: float,
          sub: int) -> Iterator[tuple[Tensor, list[Tensor]]]:
    """Yields (o [n, H, C, Dv], the state after each of its n chunks) for each segment of up to
    _CHUNKS_PER_SEGMENT chunks of q, k, v, g [N, H, C, D] and beta [N, H, C, 1] (g's D is 1 for
    a per-head decay). Only the state's walk from chunk to chunk is a loop (three ops a chunk:
    on a GPU each is a launch); everything else is batched over the segment's chunks."""
    Dk, Dv = k.shape[-1], v.shape[-1]
    for s0 in range(0, q.shape[0], _CHUNKS_PER_SEGMENT):
        seg = slice(s0, s0 + _CHUNKS_PER_SEGMENT)
        qs, ks, vs, bs = q[seg], k[seg], v[seg], beta[seg]
        G = g[seg].cumsum(-2)
        kb = ks * bs
        # UT transform: the chunk's pseudo-values are u = W_v - W_k S0 with (I + A) W = RHS,
        # A the strictly lower decayed beta-weighted key Gram matrix (its diagonal is ignored).
        # attn: the intra-chunk causal attention; one call shares the key-side decays.
        A, attn = _decayed_gram(torch.stack([kb, qs * scale]), ks, G, sub)
        w = torch.linalg.solve_triangular(A, torch.cat([vs * bs, kb * G.exp()], -1),
                                          upper=False, unitriangular=True)
        w_v, w_k = w.split([Dv, Dk], -1)
        q_dec = qs * G.exp() * scale  # reads the chunk-start state
        k_dec_t = (ks * (G[..., -1:, :] - G).exp()).transpose(-1, -2)  # writes, to the end
        chunk_decay = G[..., -1, :].exp().unsqueeze(-1)  # [n, H, D, 1] over the state's rows
        starts, us, after = [], [], []
        for i in range(qs.shape[0]):
            starts.append(state)
            u = torch.baddbmm(w_v[i], w_k[i], state, alpha=-1)  # w_v - w_k S
            us.append(u)
            state = torch.baddbmm(state * chunk_decay[i], k_dec_t[i], u)
            after.append(state)
        # every chunk's output at once: what it reads of its start state, plus within it
        yield q_dec @ torch.stack(starts) + attn @ torch.stack(us), after


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           state: Tensor, *, scale: float, chunk_size: int = 64,
                           offset: int = 0, save_every: int = 0
                           ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Chunked (UT transform) gated delta rule over one sequence.

    q, k [T, H, Dk]; v [T, H, Dv]; g [T, H] (Gated DeltaNet) or [T, H, Dk] (KDA); beta [T, H];
    state [H, Dk, Dv], the state before the first token. Returns (o [T, H, Dv] float32, final
    state, saved): saved holds the states after each token at absolute position
    p = offset + i with (p + 1) % save_every == 0, in order. Chunks are aligned to absolute
    positions (the first one is shortened), so with save_every a multiple of chunk_size those
    are chunk-end states."""
    assert save_every >= 0 and save_every % chunk_size == 0, (save_every, chunk_size)
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    if T == 0:
        return v.new_zeros(0, H, Dv, dtype=torch.float32), state.float(), []
    if g.dim() == 2:
        g = g.unsqueeze(-1)
    # Pad the front to the chunk grid of absolute positions and the back to a whole chunk with
    # k = 0, beta = 0, g = 0: identity steps that leave the state alone.
    front = offset % chunk_size
    n = (front + T + chunk_size - 1) // chunk_size

    def chunks(x: Tensor) -> Tensor:  # [T, H, D] -> [N, H, C, D]
        x = F.pad(x.float(), (0, 0, 0, 0, front, n * chunk_size - front - T))
        return x.view(n, chunk_size, H, -1).transpose(1, 2)

    sub = math.gcd(chunk_size, 16)
    steps = _scan(*map(chunks, (q, k, v, g, beta.unsqueeze(-1))), state.float(), scale, sub)
    outs, saved = [], []
    final = state.float()
    end = offset - front  # absolute position where the chunk grid starts; then each chunk end
    for o, after in steps:
        outs.append(o)
        for final in after:
            end += chunk_size
            if save_every and end % save_every == 0 and end <= offset + T:
                saved.append(final)
    o = (outs[0] if len(outs) == 1 else torch.cat(outs)).transpose(1, 2)
    o = o.reshape(n * chunk_size, H, Dv)
    return o[front:front + T], final, saved


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor, *, scale: float) -> tuple[Tensor, Tensor]:
    """One token for each of B sequences: q, k [B, H, Dk]; v [B, H, Dv]; g [B, H] or
    [B, H, Dk]; beta [B, H]; state [B, H, Dk, Dv]. Returns (o [B, H, Dv], new state), float32."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    decay = g.exp().unsqueeze(-1)  # over Dv
    if decay.dim() == 3:  # one decay per head: also over Dk
        decay = decay.unsqueeze(-1)
    S = state.float() * decay
    kv = (k.unsqueeze(-2) @ S).squeeze(-2)  # what the decayed state predicts for k
    S = S + k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - kv)).unsqueeze(-2)
    return scale * (q.unsqueeze(-2) @ S).squeeze(-2), S


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None,
                  conv_state: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv + SiLU over one sequence's chunk: x [T, C]; weight [C, K]; bias [C]
    or None; conv_state [C, K-1], the K-1 inputs before x. Returns (out [T, C] in x's dtype,
    new conv state [C, K-1]: the last K-1 inputs, taken from conv_state when T < K-1)."""
    C, K = weight.shape
    xs = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)  # [C, K-1+T]
    out = F.conv1d(xs.float().unsqueeze(0), weight.float().unsqueeze(1),
                   None if bias is None else bias.float(), groups=C)[0]
    new_state = xs[:, xs.shape[-1] - (K - 1):].to(conv_state.dtype)
    return F.silu(out).t().to(x.dtype), new_state


def causal_conv1d_step(x: Tensor, weight: Tensor, bias: Tensor | None,
                       conv_state: Tensor) -> tuple[Tensor, Tensor]:
    """One token for each of B sequences: x [B, C]; conv_state [B, C, K-1]. Returns
    (silu(out) [B, C] in x's dtype, new conv state [B, C, K-1])."""
    xs = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (xs.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return F.silu(out).to(x.dtype), xs[..., 1:].to(conv_state.dtype)

"""DeepSeek-V4's hyper-connection mixes in one kernel: from a token's projected mixes, the
`pre` and `post` gates and the `comb` matrix made doubly stochastic by Sinkhorn-Knopp
iterations (shoal/layers/hyper_connection.py is the PyTorch form and the reference).

Why a kernel: in PyTorch the 20 iterations on a 4 x 4 matrix per token are ~120 launches of
tiny kernels per hyper-connection, two of them per layer: most of an eager V4 decode step's
launches. Here one program holds one token's matrix in registers for all of it. Float32
throughout, the same operations in the same order; a sum over a row or column of at most hc
values may add in another order (within float32 rounding of the reference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _hc_mix_kernel(mixes_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, hc_eps,
                   HC: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = mixes_ptr + t * ((2 + HC) * HC)
    i = tl.arange(0, BLOCK)
    on = i < HC
    pre_s = tl.load(scale_ptr)
    post_s = tl.load(scale_ptr + 1)
    comb_s = tl.load(scale_ptr + 2)
    x = tl.load(row + i, mask=on, other=0.0) * pre_s + tl.load(base_ptr + i, mask=on, other=0.0)
    tl.store(pre_ptr + t * HC + i, 1.0 / (1.0 + tl.exp(-x)) + hc_eps, mask=on)
    x = (tl.load(row + HC + i, mask=on, other=0.0) * post_s
         + tl.load(base_ptr + HC + i, mask=on, other=0.0))
    tl.store(post_ptr + t * HC + i, 2.0 / (1.0 + tl.exp(-x)), mask=on)
    r = i[:, None]
    c = i[None, :]
    cell = (r < HC) & (c < HC)
    at = r * HC + c
    x = (tl.load(row + 2 * HC + at, mask=cell, other=0.0) * comb_s
         + tl.load(base_ptr + 2 * HC + at, mask=cell, other=0.0))
    x = tl.where(cell, x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=1)[:, None])  # softmax over each row
    m = tl.where(cell, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
    m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)  # columns first
    for _ in range(ITERS - 1):
        m = m / (tl.sum(m, axis=1)[:, None] + hc_eps)
        m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)
    tl.store(comb_ptr + t * HC * HC + at, m, mask=cell)


def hc_mix(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
           hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes float32 [T, (2 + hc) * hc] (pre, post, comb), base [(2 + hc) * hc], scale [3]
    -> (pre [T, hc], post [T, hc], comb [T, hc, hc]), float32."""
    if mixes.dim() != 2 or mixes.shape[1] != (2 + hc) * hc or mixes.dtype != torch.float32:
        raise ValueError(f"mixes must be float32 [T, {(2 + hc) * hc}], got "
                         f"{mixes.dtype} {tuple(mixes.shape)}")
    if iters < 1:
        raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {iters}")
    t = mixes.shape[0]
    mixes = mixes.contiguous()
    pre = torch.empty(t, hc, dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=mixes.device)
    if t:
        _hc_mix_kernel[(t,)](mixes, base.contiguous(), scale.contiguous(), pre, post, comb,
                             float(hc_eps), HC=hc, ITERS=iters,
                             BLOCK=triton.next_power_of_2(hc))
    return pre, post, comb

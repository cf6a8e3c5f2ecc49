"""Manifold-Constrained Hyper-Connections (mHC, DeepSeek-V4): the residual stream is hc_mult
parallel streams [T, hc, D]. Around each block (attention, MLP) one HyperConnection reads
all streams (flattened, RMS-normalized without weight, projected by `fn`) into three mixes:
`pre` collapses the streams into the block's input, `post` spreads the block's output back
over the streams, and `comb` mixes the incoming streams into the outgoing ones, a matrix made
doubly stochastic by Sinkhorn-Knopp iterations (so the residual mix cannot grow the stream's
norm). The model's end collapses the streams once more (HyperHead). Everything here runs in
float32, as transformers keeps these parameters."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.ops.dispatch import use_triton


def _flat_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, hc, D] -> [T, hc * D] float32, divided by its root mean square."""
    flat = x.flatten(1).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    def __init__(self, cfg: Any, use_triton_ops: bool = True):
        super().__init__()
        self.use_triton_ops = use_triton_ops  # CUDA: the mixes in one kernel (ops/)
        hc = self.hc = cfg.hc_mult
        self.iters, self.hc_eps, self.eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        mixes = (2 + hc) * hc  # pre (hc), post (hc), comb (hc x hc)
        self.fn = nn.Parameter(torch.empty(mixes, hc * cfg.hidden_size, dtype=torch.float32),
                               requires_grad=False)
        self.base = nn.Parameter(torch.empty(mixes, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, D] -> (post [T, hc], comb [T, hc, hc], the block's input [T, D])."""
        mixes = F.linear(_flat_rms(streams, self.eps), self.fn)
        if use_triton(mixes, self.use_triton_ops):
            from shoal.layers.ops.hyper_connection_mix import hc_mix

            pre, post, comb = hc_mix(mixes, self.base, self.scale, self.hc, self.iters,
                                     self.hc_eps)
        else:
            pre, post, comb = self.mix(mixes)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    def mix(self, mixes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected mixes [T, (2 + hc) * hc] -> (pre [T, hc], post [T, hc], comb [T, hc,
        hc]) in PyTorch (the kernel's reference)."""
        hc = self.hc
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1)
        return pre, post, self._sinkhorn(comb + self.hc_eps)

    def _sinkhorn(self, comb: torch.Tensor) -> torch.Tensor:
        """Columns, then (rows, columns) iters - 1 times, normalized to sum to 1."""
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return comb

    @staticmethod
    def merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
        """The outgoing streams: post spreads the block's output [T, D], comb (applied
        transposed: stream k takes sum_j comb[j, k] * stream j) mixes the incoming ones."""
        dtype = streams.dtype
        return (post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(1)
                + torch.matmul(comb.to(dtype).transpose(-1, -2), streams))


class HyperHead(nn.Module):
    """The final collapse of the streams into one hidden state per token."""

    def __init__(self, cfg: Any):
        super().__init__()
        hc = cfg.hc_mult
        self.hc_eps, self.eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc, hc * cfg.hidden_size, dtype=torch.float32),
                                  requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(hc, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(_flat_rms(streams, self.eps), self.hc_fn)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

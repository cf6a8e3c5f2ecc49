"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5: a short causal
convolution over q | k | v, L2-normed q and k, a per-head decay g = -exp(A_log) *
softplus(a + dt_bias) and write strength beta = sigmoid(b), the gated delta rule over them
(shoal/layers/linear_attention.py), then an RMSNorm gated by silu(z) and the out-projection.

The two checkpoints differ only in their in-projections. Qwen3-Next's `in_proj_qkvz` and
`in_proj_ba` interleave each key head's q, k, then its value heads' v and z (and b, a): a
contiguous split across ranks keeps whole key heads, so they load as plain column-parallel
rows and are un-interleaved here. Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b` and
`in_proj_a` keep each kind whole: they load into the same two matmuls as segments.

The two in-projections read the same hidden state and run as one GEMM while their weights
stay dense (shoal/layers/shared_input_linear.py): in_proj_ba is 2 * value heads rows, and
at batch 1 its GEMV was a launch's time (~5 us on an H100) for almost no bytes. Each rank
joins its own shards (both split by output rows), so tensor parallelism joins as one rank
does."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.distributed.parallel_state import get_tp_rank, get_tp_world_size
from shoal.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    SegmentedColumnLinear,
    _divide,
    segmented_loader,
)
from shoal.layers.linear_attention import LinearAttention, Rest
from shoal.layers.ops.linear_decode_fused import DecodeGates
from shoal.layers.shared_input_linear import SharedInputLinear


def rank_slice_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Rows split across ranks (per value-head vectors: A_log, dt_bias)."""
    n = param.shape[0]
    param.data.copy_(loaded.narrow(0, get_tp_rank() * n, n))


def segment_order(nk: int, r: int, dk: int, dv: int) -> torch.Tensor:
    """Where each column of Qwen3.5's segment order (q | k | v | z | b | a, each over all of a
    rank's heads) lies in Qwen3-Next's in-projection outputs side by side: in_proj_qkvz's nk
    key heads of (q dk, k dk, v r x dv, z r x dv), then in_proj_ba's nk of (b r, a r)."""
    width = 2 * dk + 2 * r * dv
    head = torch.arange(nk)[:, None] * width
    q = (head + torch.arange(dk)).flatten()
    v = (head + 2 * dk + torch.arange(r * dv)).flatten()
    b = (nk * width + torch.arange(nk)[:, None] * 2 * r + torch.arange(r)).flatten()
    return torch.cat([q, q + dk, v, v + r * dv, b, b + r])


class GatedDeltaNet(LinearAttention):
    def __init__(self, cfg: Any, dtype: torch.dtype, *, interleaved: bool):
        """interleaved: Qwen3-Next's in_proj_qkvz / in_proj_ba; else Qwen3.5's four
        in-projections."""
        tp = get_tp_world_size()
        nk = _divide(cfg.linear_num_key_heads, tp, "linear_num_key_heads")
        nv = _divide(cfg.linear_num_value_heads, tp, "linear_num_value_heads")
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        super().__init__(conv_dim=2 * nk * dk + nv * dv, conv_kernel=cfg.linear_conv_kernel_dim,
                         state_heads=nv, key_dim=dk, value_dim=dv,
                         conv_parts=(nk * dk, nk * dk, nv * dv))
        self.nk, self.nv, self.dk, self.dv = nk, nv, dk, dv
        self.interleaved = interleaved
        self.eps = cfg.rms_norm_eps
        hidden = cfg.hidden_size
        full_k, full_v = cfg.linear_num_key_heads * dk, cfg.linear_num_value_heads * dv
        heads_v = cfg.linear_num_value_heads
        if interleaved:
            self.in_proj_qkvz = ColumnParallelLinear(hidden, 2 * full_k + 2 * full_v,
                                                     params_dtype=dtype)
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * heads_v, params_dtype=dtype)
            # (a buffer: it follows the layer's device; not in the state dict)
            self.register_buffer("segments", segment_order(nk, nv // nk, dk, dv),
                                 persistent=False)
        else:
            self.in_proj_qkvz = SegmentedColumnLinear(
                hidden, [full_k, full_k, full_v, full_v], {"qkv": (0, 1, 2), "z": (3,)},
                params_dtype=dtype)
            self.in_proj_ba = SegmentedColumnLinear(hidden, [heads_v, heads_v],
                                                    {"b": (0,), "a": (1,)}, params_dtype=dtype)
        self.in_proj = SharedInputLinear(self.in_proj_qkvz, self.in_proj_ba)
        k = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, k, dtype=dtype),
                                          requires_grad=False)
        self.conv1d.weight.weight_loader = segmented_loader([full_k, full_k, full_v])
        self.A_log = nn.Parameter(torch.empty(nv, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(nv, dtype=dtype), requires_grad=False)
        self.A_log.weight_loader = self.dt_bias.weight_loader = rank_slice_loader
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(dv, dtype=dtype), requires_grad=False)
        self.out_proj = RowParallelLinear(full_v, hidden, params_dtype=dtype)

    @property
    def replay_width(self) -> int:
        return self.conv_dim + self.nv * self.dv + 2 * self.nv  # x; z, b, a

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight

    def conv_input(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Rest]:
        t = hidden.shape[0]
        if self.interleaved:  # per key head: q, k, its value heads' v, then z (and b, a):
            # one gather into Qwen3.5's order, whose parts are then views (on a GPU at batch
            # 1, one launch where a cat and three reshape copies took four)
            both = self.in_proj.joined_output(hidden)
            if both is None:  # (the projections run apart: packed or LoRA-adapted)
                both = torch.cat(self.in_proj(hidden), dim=-1)
            x, z, b, a = both.index_select(-1, self.segments).split(
                [self.conv_dim, self.nv * self.dv, self.nv, self.nv], dim=-1)
        else:
            qkvz, ba = self.in_proj(hidden)  # (column slices of one output while joined)
            x, z = qkvz.split([self.conv_dim, self.nv * self.dv], dim=-1)
            b, a = ba.split([self.nv, self.nv], dim=-1)
        return x, (z.reshape(t, self.nv, self.dv), b.reshape(t, self.nv), a.reshape(t, self.nv))

    def gates(self, rest: Rest) -> tuple[torch.Tensor, torch.Tensor]:
        _, b, a = rest
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, b.float().sigmoid()

    def heads(self, y: torch.Tensor, rest: Rest) -> tuple[torch.Tensor, ...]:
        n = y.shape[0]
        q, k, v = y.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        return (q.reshape(n, self.nk, self.dk), k.reshape(n, self.nk, self.dk),
                v.reshape(n, self.nv, self.dv), *self.gates(rest))

    def output(self, o: torch.Tensor, rest: Rest) -> torch.Tensor:
        z = rest[0]
        x = o.to(z.dtype).float()  # the rule's output in the model dtype, as transformers
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (self.norm.weight * x.to(z.dtype)) * F.silu(z.float())
        return self.project(x.to(z.dtype).reshape(o.shape[0], -1))

    def project(self, out: torch.Tensor) -> torch.Tensor:
        return self.out_proj(out)

    def decode_gates(self, rest: Rest) -> DecodeGates:
        z, b, a = rest
        return DecodeGates(decay=a, dt_bias=self.dt_bias, a_log=self.A_log, beta=b,
                           gate=z.flatten(1), norm_weight=self.norm.weight, eps=self.eps,
                           kda=False)

"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi Linear: Gated DeltaNet with
one log-decay per key channel instead of per head.

Per token: q, k, v from three projections (no key-head grouping: q, k and v have the same
heads) through one depthwise causal conv + SiLU (the checkpoint's q_conv1d, k_conv1d and
v_conv1d are segments of it); q and k L2-normed as fla does (x / sqrt(sum x^2 + 1e-6));
the decay g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias) per channel and
the write strength beta = sigmoid(b_proj(x)); the delta rule (shoal/layers/linear_attention.py);
then an RMSNorm per head gated by sigmoid(g_b_proj(g_a_proj(x))) and o_proj.

Tensor parallelism splits the heads: q | k | v | b and the two up-projections (f_b_proj,
g_b_proj) by output rows, the conv segments, dt_bias and A_log alike, o_proj by input
columns; the two rank-D down-projections (f_a_proj, g_a_proj) are replicated.

q | k | v | b and the two down-projections read the same hidden state: one GEMM while their
weights stay dense (shoal/layers/shared_input_linear.py; each rank joins its q | k | v | b
rows with the replicated down-projections). The two up-projections read different inputs
(f and g) and stay apart."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from shoal.distributed.parallel_state import get_tp_world_size
from shoal.layers.gated_delta_net import rank_slice_loader
from shoal.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    SegmentedColumnLinear,
    _divide,
    default_weight_loader,
    segmented_loader,
)
from shoal.layers.linear_attention import LinearAttention, Rest
from shoal.layers.ops.linear_decode_fused import DecodeGates
from shoal.layers.shared_input_linear import SharedInputLinear


def fla_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' / fla's KDA l2norm (sqrt and divide: rounds unlike rsqrt), in float32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kimi_softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), x itself above 20, written as transformers writes it (bit-equal)."""
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


def stacked_rows_loader(sizes: dict[str, int]):
    """A replicated parameter whose rows are named parts, stacked in the order given."""
    starts, at = {}, 0
    for name, n in sizes.items():
        starts[name], at = at, at + n

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        if shard is None:
            default_weight_loader(param, loaded)
        else:
            default_weight_loader(param.data.narrow(0, starts[shard], sizes[shard]), loaded)
    return load


def a_log_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """The checkpoint's A_log is [1, 1, H, 1]: this rank's heads of it."""
    rank_slice_loader(param, loaded.reshape(-1))


class KimiDeltaAttention(LinearAttention):
    # checkpoint tensor (under self_attn.) -> (this layer's fused parameter, shard)
    checkpoint_shards: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj.weight": ("qkvb_proj.weight", "q"),
        "k_proj.weight": ("qkvb_proj.weight", "k"),
        "v_proj.weight": ("qkvb_proj.weight", "v"),
        "b_proj.weight": ("qkvb_proj.weight", "b"),
        "q_conv1d.weight": ("conv1d.weight", "q"),
        "k_conv1d.weight": ("conv1d.weight", "k"),
        "v_conv1d.weight": ("conv1d.weight", "v"),
        "f_a_proj.weight": ("fg_a_proj.weight", "f"),
        "g_a_proj.weight": ("fg_a_proj.weight", "g"),
    }

    def __init__(self, cfg: Any, dtype: torch.dtype):
        tp = get_tp_world_size()
        heads = _divide(cfg.linear_num_heads, tp, "linear_num_heads")
        d = cfg.linear_head_dim
        super().__init__(conv_dim=3 * heads * d, conv_kernel=cfg.linear_conv_kernel_dim,
                         state_heads=heads, key_dim=d, value_dim=d,
                         conv_parts=(heads * d,) * 3)
        self.heads_per_rank, self.d, self.eps = heads, d, cfg.rms_norm_eps
        hidden, full, n = cfg.hidden_size, cfg.linear_num_heads * d, cfg.linear_num_heads
        qkvb = {"q": (0,), "k": (1,), "v": (2,), "b": (3,)}
        self.qkvb_proj = SegmentedColumnLinear(hidden, [full, full, full, n], qkvb,
                                               params_dtype=dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, self.conv_kernel,
                                                      dtype=dtype), requires_grad=False)
        self.conv1d.weight.weight_loader = segmented_loader(
            [full, full, full], {"q": (0,), "k": (1,), "v": (2,)})
        # f_a_proj and g_a_proj read the same input: one matmul
        self.fg_a_proj = ReplicatedLinear(hidden, 2 * d, params_dtype=dtype)
        self.fg_a_proj.weight.weight_loader = stacked_rows_loader({"f": d, "g": d})
        self.in_proj = SharedInputLinear(self.qkvb_proj, self.fg_a_proj)
        self.f_b_proj = ColumnParallelLinear(d, full, params_dtype=dtype)
        self.g_b_proj = ColumnParallelLinear(d, full, params_dtype=dtype)
        # transformers keeps dt_bias in float32 (_keep_in_fp32_modules_strict), not A_log
        self.dt_bias = nn.Parameter(torch.empty(heads * d, dtype=torch.float32),
                                    requires_grad=False)
        self.dt_bias.weight_loader = rank_slice_loader
        self.A_log = nn.Parameter(torch.empty(heads, dtype=dtype), requires_grad=False)
        self.A_log.weight_loader = a_log_loader
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d, dtype=dtype), requires_grad=False)
        self.o_proj = RowParallelLinear(full, hidden, params_dtype=dtype)

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight

    def conv_input(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Rest]:
        """x = q | k | v; rest = (b [T, H], forget logits [T, H*D], output gate [T, H*D])."""
        qkvb, fg = self.in_proj(hidden)  # (column slices of one output while joined)
        x, b = qkvb.split([self.conv_dim, self.heads_per_rank], dim=-1)
        f, g = fg.split([self.d, self.d], dim=-1)
        return x, (b, self.f_b_proj(f.contiguous()), self.g_b_proj(g.contiguous()))

    @property
    def replay_width(self) -> int:
        # x; b, forget logits, output gate
        return self.conv_dim + self.heads_per_rank * (1 + 2 * self.d)

    qk_norm = staticmethod(fla_l2norm)
    qk_norm_divides = True

    def gates(self, rest: Rest) -> tuple[torch.Tensor, torch.Tensor]:
        b, f, _ = rest
        g = kimi_softplus(f.float() + self.dt_bias.float()).view(-1, self.heads_per_rank, self.d)
        g = -self.A_log.float().exp().unsqueeze(-1) * g
        # beta's sigmoid in the model dtype, as transformers takes it
        return g, b.sigmoid().float()

    def heads(self, y: torch.Tensor, rest: Rest) -> tuple[torch.Tensor, ...]:
        n, h, d = y.shape[0], self.heads_per_rank, self.d
        q, k, v = (t.reshape(n, h, d) for t in y.split(h * d, dim=-1))
        return (q, k, v, *self.gates(rest))

    def output(self, o: torch.Tensor, rest: Rest) -> torch.Tensor:
        gate = rest[2]
        t, dtype = o.shape[0], gate.dtype
        x = o.to(dtype).float()  # the rule's output in the model dtype, as transformers
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.o_norm.weight.float() * x * gate.view(t, self.heads_per_rank, self.d).float().sigmoid()
        return self.project(x.to(dtype).reshape(t, -1))

    def project(self, out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(out)

    def decode_gates(self, rest: Rest) -> DecodeGates:
        b, f, gate = rest
        return DecodeGates(decay=f, dt_bias=self.dt_bias, a_log=self.A_log, beta=b, gate=gate,
                           norm_weight=self.o_norm.weight, eps=self.eps, kda=True)

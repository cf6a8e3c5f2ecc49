"""A MoE layer's shared experts (DeepSeek-V2 / V3, Kimi-K2, GLM-4-MoE: n_shared_experts
always-on experts as one SwiGLU MLP of n_shared * moe_intermediate_size; Qwen3-Next and
Qwen3.5-MoE: one shared expert whose output is scaled per token by sigmoid(x . g), g the
[1, H] shared_expert_gate) as the routed experts' kernels may take them: at decode sizes the
bf16 decode kernels (half_decode_experts.py) run the MLP inside their two launches, its
intermediate dim cut into chunks of the routed experts' I, each chunk an extra
always-selected slot of weight 1 (routed_scaling_factor scales the routed weights only, in
the router) or, gated, of the token's sigmoid(x . g) (computed by T more gate_up programs),
summed after the routed slots in the down kernel's fixed order. Elsewhere `run` (the MLP
module, its own launches, the gate's included) is added to the routed sum.

The weights are the MLP's own parameters, read at each call: never copied or stacked, so an
in-place weight update (worker/lifecycle.py) or an offloaded layer's swapped storage is what
the next step reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SharedExperts:
    """run(x) -> this rank's partial [T, H] of the shared MLP (the caller's all-reduce sums
    it with the routed experts'). gate_up [2S, H] (gate rows then up rows) and down [H, S]:
    the MLP's dense weights, or None where the kernels cannot read them (quantized or
    LoRA-wrapped projections, biases): then only run is used. gate [1, H]: the shared
    gate's row (run scales the MLP's output by sigmoid(x . gate) per token), None for an
    ungated MLP; a gated MLP whose gate the kernels cannot read has no dense weights."""

    run: Callable[[torch.Tensor], torch.Tensor]
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    gate: torch.Tensor | None = None

    def chunks(self, x: torch.Tensor, inter: int) -> int:
        """How many slots of the routed intermediate size `inter` the decode kernels walk for
        these weights beside x: S / inter, or 0 where they cannot (no dense weights, another
        dtype, strided, S not a multiple of inter, or a gate that is not [1, H] alike)."""
        gu, dn = self.gate_up, self.down
        if gu is None or dn is None or inter < 1:
            return 0
        s = dn.shape[1] if dn.dim() == 2 else 0
        if (gu.dim() != 2 or tuple(gu.shape) != (2 * s, x.shape[-1])
                or tuple(dn.shape) != (x.shape[-1], s) or s % inter or s == 0):
            return 0
        if not (gu.dtype == dn.dtype == x.dtype) or gu.device != x.device:
            return 0
        if not (gu.is_contiguous() and dn.is_contiguous()):
            return 0
        g = self.gate
        if g is not None and (tuple(g.shape) != (1, x.shape[-1]) or g.dtype != x.dtype
                              or g.device != x.device or not g.is_contiguous()):
            return 0
        return s // inter


def _dense_weight(linear: Any) -> torch.Tensor | None:
    """A parallel (or replicated) linear's plain weight, or None where its forward is more
    than x W^T: packed (quant / int4), a LoRA hook, or a bias."""
    if getattr(linear, "quant", None) is not None or getattr(linear, "int4", None) is not None:
        return None
    if getattr(linear, "lora", None) is not None or getattr(linear, "bias", None) is not None:
        return None
    weight = getattr(linear, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def shared_experts_of(mlp: Any) -> SharedExperts:
    """The shared experts of an MLP with gate_up_proj (merged gate then up rows) and
    down_proj whose forward is down(silu_and_mul(gate_up(x))) (DeepseekMLP)."""
    gate_up, down = _dense_weight(mlp.gate_up_proj), _dense_weight(mlp.down_proj)
    if gate_up is None or down is None:
        return SharedExperts(mlp)
    return SharedExperts(mlp, gate_up, down)


def gated_shared_expert_of(mlp: Any, gate: Any) -> SharedExperts:
    """Qwen3-Next's / Qwen3.5-MoE's shared expert: an MLP as shared_experts_of takes it,
    scaled per token by sigmoid(gate(x)), gate a linear of one output (shared_expert_gate).
    mlp's partial sums are this rank's (its down projection does not all-reduce): the
    caller reduces them with the routed experts'."""

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(gate(x)) * mlp(x)

    gate_up, down = _dense_weight(mlp.gate_up_proj), _dense_weight(mlp.down_proj)
    row = _dense_weight(gate)
    if gate_up is None or down is None or row is None:
        return SharedExperts(run)
    return SharedExperts(run, gate_up, down, row)

"""A MoE layer's shared experts (DeepSeek-V2 / V3, Kimi-K2, GLM-4-MoE: n_shared_experts
always-on experts as one SwiGLU MLP of n_shared * moe_intermediate_size) as the routed
experts' kernels may take them: at decode sizes the bf16 decode kernels
(half_decode_experts.py) run the MLP inside their two launches, its intermediate dim cut
into chunks of the routed experts' I, each chunk an extra always-selected slot of weight 1
(routed_scaling_factor scales the routed weights only, in the router), summed after the
routed slots in the down kernel's fixed order. Elsewhere `run` (the MLP module, its own
launches) is added to the routed sum.

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
    LoRA-wrapped projections, biases): then only run is used."""

    run: Callable[[torch.Tensor], torch.Tensor]
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None

    def chunks(self, x: torch.Tensor, inter: int) -> int:
        """How many slots of the routed intermediate size `inter` the decode kernels walk for
        these weights beside x: S / inter, or 0 where they cannot (no dense weights, another
        dtype, strided, or S not a multiple of inter)."""
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
        return s // inter


def _dense_weight(linear: Any) -> torch.Tensor | None:
    """A parallel linear's plain weight, or None where its forward is more than x W^T: packed
    (quant / int4), a LoRA hook, or a bias."""
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

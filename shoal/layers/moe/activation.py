"""What an expert applies between its two projections: [N, 2I] (the gate half, then the up
half, FusedMoE's w13 layout) -> [N, I].

"silu" is SiLU(gate) * up (Mixtral, Qwen, DeepSeek). "clamped_swiglu" is gpt-oss's: the gate
clamped from above and the up projection on both sides at `limit`, gate * sigmoid(alpha *
gate) (a sharper SiLU), times (up + 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class ExpertActivation:
    kind: str = "silu"
    alpha: float = 1.702  # clamped_swiglu only
    limit: float = 7.0  # clamped_swiglu only

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"expert activation must be one of {KINDS}, got {self.kind!r}")

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = ExpertActivation()

"""DeepSeek-V4's expert routing and expert activation, as transformers computes them.

Scores are sqrt(softplus(logits)) of the gate (scoring_func "sqrtsoftplus"; "sigmoid" also
read). A routed layer picks the top-k experts of the scores plus e_score_correction_bias; a
hash layer (mlp_layer_types "hash_moe", the first layers) takes its k experts from a fixed
token id -> experts table (tid2eid), so it needs the step's input ids. Either way the weights
are the picked experts' unbiased scores, renormalized to sum to 1, times
routed_scaling_factor. Routing runs in float32.

The experts' activation is a clipped SwiGLU: the gate clamped from above and the up
projection on both sides at swiglu_limit, then SiLU(gate) * up (FusedMoE's activation hook:
shoal/layers/moe/activation.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.moe.activation import ExpertActivation


@dataclass(frozen=True)
class ClippedSwiGLU(ExpertActivation):
    kind: str = "clipped_silu"

    def __post_init__(self) -> None:  # (a kind of its own: not one of activation.KINDS)
        pass

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)


_SCORES = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


class DeepseekV4Router(nn.Module):
    """weight [E, hidden]; routed layers: e_score_correction_bias [E]; hash layers: tid2eid
    [vocab, k] (int64, a parameter so the loader checks the checkpoint filled it; it starts
    spread evenly over the experts, what load_format="dummy" keeps)."""

    def __init__(self, cfg: Any, hashed: bool):
        super().__init__()
        if cfg.scoring_func not in _SCORES:
            raise ValueError(f"DeepSeek-V4 scoring_func must be one of {sorted(_SCORES)}, got "
                             f"{cfg.scoring_func!r}")
        self.score = _SCORES[cfg.scoring_func]
        self.top_k, self.hashed = cfg.num_experts_per_tok, hashed
        self.scaling = cfg.routed_scaling_factor
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        if hashed:
            spread = torch.arange(cfg.vocab_size * self.top_k).view(-1, self.top_k) % e
            self.tid2eid = nn.Parameter(spread, requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden], input_ids [T] -> (float32 weights [T, k], int64 expert ids [T, k])."""
        scores = self.score(F.linear(x.float(), self.weight))
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1,
                             sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

"""Routing checkpoint tensors of sparse MoE layers into FusedMoE's stacked parameters, for
every model whose experts live under `...mlp.experts` (Qwen3-MoE, DeepSeek-V2/V3)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

# model.layers.N.mlp.experts.E.gate_proj.weight: one expert's projection, as checkpoints store it.
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
# model.layers.N.mlp.experts.gate_up_proj: all experts stacked, transformers 5's in-memory layout.
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_SHARD = {"gate": "w1", "up": "w3", "down": "w2"}


def load_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]],
                        params: dict[str, nn.Parameter], loaded: set[str],
                        owner: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Loads the expert tensors among `weights` into the `w13_weight` / `w2_weight` of their
    FusedMoE (adding the names to `loaded`) and yields every other tensor unchanged."""

    def load(prefix: str, proj: str, expert: int, tensor: torch.Tensor) -> None:
        name = f"{prefix}.{'w2' if proj == 'down' else 'w13'}_weight"
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint expert tensor for {name!r} has no matching "
                             f"parameter in {owner}")
        param.weight_loader(param, tensor.to(param.dtype), expert, _SHARD[proj])
        loaded.add(name)

    for name, tensor in weights:
        if m := _EXPERT.match(name):
            load(m[1], m[3], int(m[2]), tensor)
        elif m := _STACKED.match(name):
            for e, t in enumerate(tensor.unbind(0)):
                if m[2] == "down_proj":
                    load(m[1], "down", e, t)
                else:
                    gate, up = t.chunk(2, dim=0)
                    load(m[1], "gate", e, gate)
                    load(m[1], "up", e, up)
        else:
            yield name, tensor

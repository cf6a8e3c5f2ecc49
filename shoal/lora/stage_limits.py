"""LoRA under pipeline parallelism: each stage holds the adapter slots of its own decoder
layers, yet an adapter is checked against the whole model, so that a module of a layer of
another stage is taken and a module of no stage is refused by name, as on one stage. At start-up
the ranks share their projections (every rank's LoRALimits gathered over the ranks' group and
merged); at load time each stage reads only the adapter's tensors of its own layers."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from shoal.distributed.parallel_state import get_pp_world_size
from shoal.lora.adapter import AdapterSpec, LoRALimits
from shoal.lora.expert_adapter import expert_target


def whole_model_limits(stage: LoRALimits) -> LoRALimits:
    """This stage's limits merged with every other stage's (unchanged with one stage). A
    collective: every rank of the engine calls it, at the same point of start-up."""
    if get_pp_world_size() == 1:
        return stage
    gathered: list[tuple[dict, dict, tuple] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (stage.targets, stage.experts, stage.left_out))
    targets: dict[str, tuple[int, int]] = {}
    experts: dict[str, tuple[int, int, int]] = {}
    left_out: set[str] = set()
    for rank_targets, rank_experts, rank_left_out in gathered:  # stage order: layers' order
        targets.update(rank_targets)
        experts.update(rank_experts)
        left_out.update(rank_left_out)
    return LoRALimits(stage.max_loras, stage.max_lora_rank, targets, experts,
                      tuple(sorted(left_out)))


@dataclasses.dataclass(frozen=True)
class StageModules:
    """The checkpoint modules this stage's LoRA layers adapt."""

    targets: frozenset[str]  # projections (LoRALimits.targets keys)
    experts: frozenset[str]  # MoE experts modules (LoRALimits.experts keys)

    @classmethod
    def of(cls, limits: LoRALimits) -> StageModules:
        return cls(frozenset(limits.targets), frozenset(limits.experts))

    def owns(self, module: str) -> bool:
        """Whether an adapter's module (AdapterSpec.modules key) is on this stage."""
        target = expert_target(module)
        return module in self.targets if target is None else target.layer in self.experts

    def part_of(self, spec: AdapterSpec) -> AdapterSpec:
        """The adapter's modules of this stage (an empty set where it adapts none here)."""
        return dataclasses.replace(
            spec, modules={n: m for n, m in spec.modules.items() if self.owns(n)})

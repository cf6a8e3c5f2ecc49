"""LoRA on the routed experts of a MoE layer, as PEFT writes it (torch-free: the frontend and
the engine core check adapters with it).

Two layouts reach shoal:

- per expert, `model.layers.N.mlp.experts.E.gate_proj` (up_proj, down_proj; Mixtral's w1, w3,
  w2): what PEFT saved before transformers 5, when the experts were nn.Linear modules. Each is
  a plain A [r, in] / B [out, r] pair of one expert.
- PEFT's target_parameters over transformers 5's stacked expert tensors (also what PEFT makes
  of target_modules=[gate_proj, up_proj, down_proj] on transformers 5: one gate_up_proj
  adapter of rank 2r). Each targeted parameter gets a ParamWrapper; two on one module nest, so
  the saved names do not say which parameter a pair adapts: the wrapper made last is the
  outermost (`experts.lora_A`), the first one sits under `experts.base_layer`. PEFT wraps a
  module's parameters in their registration order, gate_up_proj before down_proj in every
  transformers MoE. The pair is A [E * r, in] (expert e's rows e*r:(e+1)*r) and B [out, E * r]
  (expert e's columns e, e + E, e + 2E, ...: B.view(out, r, E)[:, :, e]).

Here both get one name per adapted tensor (`...experts.3.gate_proj`, `...experts.gate_up_proj`)
and are checked against the model's MoE layers (LoRALimits.experts)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# transformers 5's stacked expert parameters, in the order their modules register them
STACKED = ("gate_up_proj", "down_proj")
# per-expert module leaves -> the projection they are
PER_EXPERT = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
              "w1": "gate", "w3": "up", "w2": "down"}
_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)")
_STACKED = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)")


@dataclass(frozen=True)
class ExpertTarget:
    layer: str  # the MoE layer's experts module: model.layers.0.mlp.experts
    expert: int | None  # None: all experts at once (a stacked parameter)
    proj: str  # "gate", "up", "down" (per expert) or "gate_up", "down" (stacked)


def expert_target(name: str) -> ExpertTarget | None:
    """What an adapted module name of the adapter (after stacked_name) means, None for a
    name that is not a routed expert's."""
    if m := _PER_EXPERT.fullmatch(name):
        return ExpertTarget(m[1], int(m[2]), PER_EXPERT[m[3]])
    if m := _STACKED.fullmatch(name):
        return ExpertTarget(m[1], None, m[2].removesuffix("_proj"))
    return None


def stacked_name(module: str, config: dict[str, Any]) -> str:
    """The name of the stacked expert parameter a ParamWrapper pair at `module` adapts
    (`...experts.base_layer` -> `...experts.gate_up_proj`), from the config's
    target_parameters as PEFT matches them; `module` unchanged where it is no such pair."""
    targets = config.get("target_parameters") or []
    depth, wrapper = 0, module
    while module.endswith(".base_layer"):
        module, depth = module.removesuffix(".base_layer"), depth + 1
    if not module.endswith(".experts"):
        return wrapper
    wrapped = [p for p in STACKED if any(
        f"{module}.{p}" == t or f"{module}.{p}".endswith(f".{t}") for t in targets)]
    if depth >= len(wrapped):
        return wrapper
    return f"{module}.{wrapped[len(wrapped) - 1 - depth]}"


def expert_shape(target: ExpertTarget, hidden: int, inter: int) -> tuple[int, int]:
    """(in_features, out_features) of the adapted projection of one expert."""
    if target.proj == "down":
        return inter, hidden
    return hidden, 2 * inter if target.proj == "gate_up" else inter


def check_experts(where: str, modules: dict[str, Any], experts: dict[str, tuple[int, int, int]],
                  max_rank: int) -> None:
    """Each expert module of the adapter (ModuleAdapter by name) against the model's MoE layers
    (experts module name -> (num_experts, hidden, moe_intermediate)); ValueError naming the
    module. gate_up_proj, gate and up fused, takes a rank up to 2 * max_rank: PEFT doubles r
    there when it turns gate_proj and up_proj targets into it."""
    layouts: dict[tuple[str, str], set[bool]] = {}
    for name, mod in modules.items():
        target = expert_target(name)
        if target is None:
            continue
        shape = experts.get(target.layer)
        if shape is None:
            raise ValueError(f"{where} adapts MoE experts ({name}), but this model has no MoE "
                             f"layer {target.layer!r} that takes LoRA")
        num_experts, hidden, inter = shape
        if target.expert is not None and target.expert >= num_experts:
            raise ValueError(f"{where} adapts expert {target.expert} ({name}), out of range: "
                             f"{target.layer} has experts 0..{num_experts - 1}")
        if target.expert is None and mod.experts != num_experts:
            raise ValueError(f"{where}: {name} holds {mod.experts} experts of rank {mod.rank} "
                             f"(A has {mod.experts * mod.rank} rows) but {target.layer} has "
                             f"{num_experts}")
        limit = 2 * max_rank if target.proj == "gate_up" else max_rank
        if mod.rank > limit:
            raise ValueError(f"{where} has rank {mod.rank} on {name}, more than "
                             f"{'2 * ' if limit != max_rank else ''}max_lora_rank ({max_rank})")
        want = expert_shape(target, hidden, inter)
        if (mod.in_features, mod.out_features) != want:
            raise ValueError(f"{where}: {name} is {mod.in_features} -> {mod.out_features} "
                             f"in the adapter but {want[0]} -> {want[1]} in the model (an "
                             "adapter of another base model?)")
        stage = "down" if target.proj == "down" else "gate_up"
        layouts.setdefault((target.layer, stage), set()).add(target.expert is None)
    for (layer, stage), kinds in layouts.items():
        if len(kinds) > 1:
            raise ValueError(f"{where} adapts the {stage} projections of {layer} both per "
                             "expert and as one stacked tensor")

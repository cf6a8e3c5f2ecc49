"""Which of the model's modules get adapter slots: vLLM's deployment-time `target_modules`
(--lora-target-modules), module-name suffixes, plus two names of shoal's (torch-free).

- None (the default, as vLLM): every projection shoal can adapt (q/k/v/o, gate/up/down and
  the families' own names) and the MoE routed experts. The expert slots hold `max_loras`
  adapters of every expert of every MoE layer (gigabytes on a Qwen3-30B-A3B at rank 16: the
  start-up log gives the figure), paid whether or not any adapter adapts experts; a list
  without `experts` (e.g. `all-linear`) leaves them out.
- A list: the projections whose checkpoint leaf name is listed (a fused name, qkv_proj or
  gate_up_proj, stands for its parts; a fused layer listed by any part takes adapters on all
  its parts, its slots being one tensor), `all-linear` (PEFT's name) for every projection,
  and `experts` for the routed experts of the MoE layers.

An adapter of a module the setting leaves out is refused by name (LoRALimits.left_out), never
served partly."""

from __future__ import annotations

from collections.abc import Iterable

from shoal.config.lora import ALL_LINEAR, EXPERTS


def expand(targets: tuple[str, ...] | None, fused: dict[str, list[str]]
           ) -> frozenset[str] | None:
    """The setting with each fused layer name joined by its parts (the model's
    packed_modules_mapping: fused leaf -> checkpoint leaves)."""
    if targets is None:
        return None
    return frozenset(targets) | {part for t in targets for part in fused.get(t, [])}


def wants_layer(targets: frozenset[str] | None, leaves: Iterable[str]) -> bool:
    """Whether a projection layer takes adapters (`leaves`: its own leaf name and its
    checkpoint parts')."""
    if targets is None or ALL_LINEAR in targets:
        return True
    return any(leaf in targets for leaf in leaves)


def wants_experts(targets: frozenset[str] | None) -> bool:
    return targets is None or EXPERTS in targets


def lists_experts(targets: frozenset[str] | None) -> bool:
    """Whether the setting names the experts itself (not only by being unset)."""
    return targets is not None and EXPERTS in targets


def unknown_names(targets: frozenset[str] | None, known: Iterable[str]) -> list[str]:
    """The entries that name nothing of the model (`known`: its adaptable leaves, `experts`
    where it has MoE layers)."""
    if targets is None:
        return []
    return sorted(targets - set(known) - {ALL_LINEAR})

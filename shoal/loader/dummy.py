"""Random weights for load_format="dummy": benchmarking and tests without real checkpoints."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from shoal.layers.moe.deferred_stacks import deferred_layers, materialize

logger = logging.getLogger(__name__)


@torch.no_grad()
def initialize_dummy_weights(
    module: torch.nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3,
    device: torch.device | None = None,
) -> None:
    """Fill every parameter of `module` in place with U(low, high), deterministically per seed.

    Small values keep activations finite through deep stacks; norm weights get the same treatment
    since the outputs are meaningless either way. `device`: draw every value there, also for a
    parameter kept elsewhere (weight offloading's host copies), so a model gets the same
    weights whichever of its parameters are offloaded.

    MoE layers whose dense stacks were deferred (expected packed:
    shoal/layers/moe/deferred_stacks.py) get their plan's random packed experts first; one
    without a maker gets its dense stacks, drawn as the rest.
    """
    generators: dict[torch.device, torch.Generator] = {}

    def generator_for(where: torch.device) -> torch.Generator:
        if where not in generators:
            # one generator per device: torch refuses a CPU generator for CUDA tensors
            generators[where] = torch.Generator(device=where).manual_seed(seed)
        return generators[where]

    _random_packed_experts(module, generator_for)
    for _, param in module.named_parameters():
        if param.device.type == "meta":
            continue
        where = torch.device(device) if device is not None else param.device
        generator = generator_for(where)
        if not param.is_floating_point():
            continue
        materialize(param)  # (a deferred stack the packed experts did not replace)
        if param.device.type == where.type:
            param.uniform_(low, high, generator=generator)
        else:
            drawn = torch.empty(param.shape, dtype=param.dtype, device=where)
            param.copy_(drawn.uniform_(low, high, generator=generator))


def _random_packed_experts(module: torch.nn.Module,
                           generator_for: Callable[[torch.device], torch.Generator]) -> None:
    """Each deferred MoE layer: its plan's random packed experts, drawn on its device."""
    kinds: dict[str, list[str]] = {}
    for name, layer in list(deferred_layers(module)):
        plan = layer.packed_plan
        if plan is None or plan.random is None:
            continue
        layer.install(plan.random(layer, generator_for(layer.w13_weight.device)))
        kinds.setdefault(layer.quant.name, []).append(name)
    for kind, names in kinds.items():
        logger.info("dummy weights: random %s in %d MoE layer(s) (e.g. %s)", kind, len(names),
                    names[0])

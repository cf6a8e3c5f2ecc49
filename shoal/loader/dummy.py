"""Random weights for load_format="dummy": benchmarking and tests without real checkpoints."""

from __future__ import annotations

import torch


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
    """
    generators: dict[torch.device, torch.Generator] = {}
    for _, param in module.named_parameters():
        if param.device.type == "meta":
            continue
        where = torch.device(device) if device is not None else param.device
        generator = generators.get(where)
        if generator is None:
            # one generator per device: torch refuses a CPU generator for CUDA tensors
            generator = torch.Generator(device=where).manual_seed(seed)
            generators[where] = generator
        if not param.is_floating_point():
            continue
        if param.device.type == where.type:
            param.uniform_(low, high, generator=generator)
        else:
            drawn = torch.empty(param.shape, dtype=param.dtype, device=where)
            param.copy_(drawn.uniform_(low, high, generator=generator))

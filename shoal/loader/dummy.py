"""Random weights for load_format="dummy": benchmarking and tests without real checkpoints."""

from __future__ import annotations

import torch


@torch.no_grad()
def initialize_dummy_weights(
    module: torch.nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3
) -> None:
    """Fill every parameter of `module` in place with U(low, high), deterministically per seed.

    Small values keep activations finite through deep stacks; norm weights get the same treatment
    since the outputs are meaningless either way.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for _, param in module.named_parameters():
        if param.device.type == "meta":
            continue
        generator = generators.get(param.device)
        if generator is None:
            # one generator per device: torch refuses a CPU generator for CUDA tensors
            generator = torch.Generator(device=param.device).manual_seed(seed)
            generators[param.device] = generator
        if param.is_floating_point():
            param.uniform_(low, high, generator=generator)

"""Sleep and wake of a rank's model (vLLM's sleep mode, for engines inside training loops).

Level 1 copies every parameter and buffer to host memory (pinned on CUDA) and frees its device
storage; level 2 frees the parameters without a copy (the weights come back through a weight
update) and keeps a copy of the buffers (rotary tables and the like, which no update carries).
A tensor keeps its identity while asleep: its storage is resized to nothing and back, so the
model's modules, tied weights and views stay as they are; only the storage's address moves,
which is why CUDA graphs are captured again at wake-up. Storages are visited once each (a
tied embedding and LM head share one)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class SleepingWeights:
    level: int
    # (tensor whose storage was freed, its size in bytes, host copy or None at level 2)
    storages: list[tuple[torch.Tensor, int, torch.Tensor | None]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.storages)


def _storage_owners(modules: list[nn.Module]) -> list[tuple[torch.Tensor, bool]]:
    """One tensor per distinct non-empty storage of the modules' parameters and buffers, and
    whether it is a parameter's."""
    seen: set[int] = set()
    owners = []
    for module in modules:
        tensors = [(p, True) for p in module.parameters()] + [(b, False)
                                                              for b in module.buffers()]
        tensors += [(t, False) for t in _packed_tensors(module)]
        for t, is_param in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            owners.append((t, is_param))
    return owners


def _packed_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors of quantized linears' packed weights on CUDA (a `quant` object beside the
    layer's emptied dense weight, shoal/layers/quantization/methods.py): not parameters, and
    no weight update can refill them, so they are kept like buffers at both levels."""
    out = []
    for m in module.modules():
        quant = getattr(m, "quant", None)
        if quant is not None and dataclasses.is_dataclass(quant):
            out += [v for v in vars(quant).values() if isinstance(v, torch.Tensor)]
    return out


def put_to_sleep(modules: list[nn.Module], level: int) -> SleepingWeights:
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2 (got {level!r})")
    asleep = SleepingWeights(level)
    for t, is_param in _storage_owners(modules):
        storage = t.untyped_storage()
        copy = None
        if level == 1 or not is_param:
            copy = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=t.is_cuda)
            copy.untyped_storage().copy_(storage)
        asleep.storages.append((t, storage.nbytes(), copy))
        storage.resize_(0)
    return asleep


def wake(asleep: SleepingWeights) -> None:
    """Every storage back at its size; level 1 also gets its bytes back (level 2 keeps what
    the allocator gives, until a weight update fills it)."""
    for t, nbytes, copy in asleep.storages:
        storage = t.untyped_storage()
        storage.resize_(nbytes)
        if copy is not None:
            storage.copy_(copy.untyped_storage(), non_blocking=t.is_cuda)
    if any(t.is_cuda for t, _, _ in asleep.storages):
        torch.cuda.synchronize()
    asleep.storages.clear()

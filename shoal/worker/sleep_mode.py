"""Sleep and wake of a rank's model (vLLM's sleep mode, for engines inside training loops).

Level 1 copies every parameter and buffer to host memory (pinned on CUDA) and frees its device
storage; level 2 frees the parameters without a copy (the weights come back through a weight
update) and keeps a copy of the buffers (rotary tables and the like, which no update carries).
A tensor keeps its identity while asleep: its storage is resized to nothing and back, so the
model's modules, tied weights and views stay as they are; only the storage's address moves,
which is why CUDA graphs are captured again at wake-up. Storages are visited once each (a
tied embedding and LM head share one).

Level 1's host buffers outlive the sleep (HostCopies, kept by the caller): pinning gigabytes
takes seconds and, repeated over hundreds of sleep / wake cycles, fragments host memory, so
the first sleep allocates them and later ones copy into the same buffers. A level-2 sleep
releases them (it is the level that gives memory back).

On CUDA the copies run on a side stream, queued back to back: a sleep waits for them once,
before it frees the device storages; a wake-up returns with its copies still under way, and
the device's current stream waits for them, so the first forward (or anything else queued on
it) reads the weights only once they have landed."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class SleepingWeights:
    level: int
    # (tensor whose storage was freed, its size in bytes, host copy or None at level 2)
    storages: list[tuple[torch.Tensor, int, torch.Tensor | None]] = field(default_factory=list)
    copies_kept: bool = False  # the host copies outlive the wake-up (HostCopies holds them)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.storages)


class HostCopies:
    """The host buffers of level-1 sleeps, kept from one sleep to the next. Slot i holds the
    i-th storage a sleep copies (the model's parameters and buffers in their order, which
    does not change); a slot is reused while its byte size is the same (the bytes are raw, so
    a change of dtype or shape that keeps the size changes nothing for a copy) and replaced
    when it is not."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.allocations = 0  # buffers allocated over the engine's life (tests: no growth)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def take(self, sizes: list[int], pinned: bool) -> list[torch.Tensor]:
        """One uint8 host buffer per size, the kept ones where they fit."""
        out = []
        for i, nbytes in enumerate(sizes):
            kept = self.buffers[i] if i < len(self.buffers) else None
            if kept is None or kept.numel() != nbytes or kept.is_pinned() != pinned:
                kept = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
                self.allocations += 1
            out.append(kept)
        self.buffers = out  # (a slot replaced or no longer needed is released here)
        return out

    def keep_if(self, sizes: list[int]) -> None:
        """Releases every buffer unless the storages still have these sizes (after a weight
        update: one that changed a shape would leave buffers no sleep can reuse)."""
        if [b.numel() for b in self.buffers] != sizes:
            self.release()

    def release(self) -> None:
        self.buffers = []


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


def kept_sizes(modules: list[nn.Module], scratch: Sequence[torch.Tensor] = ()) -> list[int]:
    """The byte sizes of the storages a level-1 sleep copies, in order (HostCopies' slots)."""
    return [t.untyped_storage().nbytes() for t in _copied(_storage_owners(modules), 1, scratch)]


def _copied(owners: list[tuple[torch.Tensor, bool]], level: int,
            scratch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The owners whose bytes a sleep of this level keeps."""
    skip = {t.untyped_storage().data_ptr() for t in scratch}
    return [t for t, is_param in owners if t.untyped_storage().data_ptr() not in skip
            and (level == 1 or not is_param)]


def put_to_sleep(modules: list[nn.Module], level: int, host: HostCopies | None = None,
                 scratch: Sequence[torch.Tensor] = ()) -> SleepingWeights:
    """host: the buffers kept between sleeps (None: fresh ones, dropped at wake-up); a
    level-2 sleep releases them. scratch: tensors whose storages are freed without a copy
    at both levels (their content does not matter: weight offloading's staging buffer)."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2 (got {level!r})")
    owners = _storage_owners(modules)
    device = next((t.device for t, _ in owners if t.is_cuda), None)
    if device is not None:  # nothing queued (on any stream) still uses a storage
        torch.cuda.synchronize(device)
    copied = _copied(owners, level, scratch)
    sizes = [t.untyped_storage().nbytes() for t in copied]
    if host is not None and level == 1:
        buffers = host.take(sizes, pinned=device is not None)
    else:
        if host is not None:
            host.release()
        buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=device is not None)
                   for n in sizes]
    copy_of = {id(t): b for t, b in zip(copied, buffers)}
    with _side_stream(device):
        for t in copied:
            copy_of[id(t)].untyped_storage().copy_(t.untyped_storage(),
                                                    non_blocking=device is not None)
    if device is not None:
        _copy_stream(device).synchronize()  # the bytes are out before the storages go
    asleep = SleepingWeights(level, copies_kept=host is not None and level == 1)
    for t, _ in owners:
        storage = t.untyped_storage()
        asleep.storages.append((t, storage.nbytes(), copy_of.get(id(t))))
        storage.resize_(0)
    return asleep


def wake(asleep: SleepingWeights) -> None:
    """Every storage back at its size; level 1 also gets its bytes back (level 2 keeps what
    the allocator gives, until a weight update fills it). On CUDA the copies may still be
    running on return: the current stream waits for them."""
    device = next((t.device for t, _, _ in asleep.storages if t.is_cuda), None)
    for t, nbytes, _ in asleep.storages:
        t.untyped_storage().resize_(nbytes)
    if device is not None:  # (after what the current stream queued on the new storages)
        _copy_stream(device).wait_stream(torch.cuda.current_stream(device))
    with _side_stream(device):
        for t, _, copy in asleep.storages:
            if copy is not None:
                t.untyped_storage().copy_(copy.untyped_storage(), non_blocking=t.is_cuda)
    if device is not None:
        torch.cuda.current_stream(device).wait_stream(_copy_stream(device))
        if not asleep.copies_kept:  # (the copies' sources go with this wake-up)
            _copy_stream(device).synchronize()
    asleep.storages.clear()


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for sleep's copies (a new one per sleep would gain
    nothing)."""
    return torch.cuda.Stream(device)


def _side_stream(device: torch.device | None) -> contextlib.AbstractContextManager[Any]:
    return (torch.cuda.stream(_copy_stream(device)) if device is not None
            else contextlib.nullcontext())

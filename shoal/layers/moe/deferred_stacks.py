"""Dense expert stacks left unallocated while a layer's experts are expected packed.

A quantized MoE checkpoint (FP8 or INT4 experts on the GPU fast path, gpt-oss's MXFP4) ends
with its experts packed (FusedMoE.install_*), its dense w13_weight / w2_weight dropped
unread. Allocated first, they made the load's peak the dense size (GPT-OSS-120B's or
Kimi-K2's fits no GPU). While a `PackedExpertsPlan` is in force (loader/build.py, around the
model's construction, from the fast path's plan; gpt-oss's layers pass MXFP4's), FusedMoE
builds each stack *deferred*: a Parameter of the dense shape, dtype and device over one
element of storage (stride 0 in every dimension). The loaders read its shape, dtype and
device as they read a dense stack's, and a write into it raises (torch refuses to write
overlapping memory) rather than lose values. What needs the experts dense after all (a shard
that arrives dense, a refused layer dequantized, a device without the kernel) calls
`materialize` first: that layer's stacks alone are allocated, as before.
load_format="dummy" fills a deferred layer with the plan's random packed experts (valid codes
and scales of the config's scheme: random_experts.py); without a maker it is drawn dense."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

STACKS = ("w13_weight", "w2_weight")


@dataclass(frozen=True)
class PackedExpertsPlan:
    kind: str  # the packed form expected: "fp8", "int4" or "mxfp4"
    # load_format="dummy": the random packed experts of a layer (None: drawn dense)
    random: Callable[[nn.Module, torch.Generator], Any] | None = None


_PLAN: ContextVar[PackedExpertsPlan | None] = ContextVar("packed_experts_plan", default=None)


@contextmanager
def packed_experts_expected(plan: PackedExpertsPlan | None) -> Iterator[None]:
    """FusedMoE layers built inside defer their dense stacks (None: they do not)."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def current_plan() -> PackedExpertsPlan | None:
    return _PLAN.get()


def deferred_stack(*shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense shape over one element on the default device (the build's device)."""
    return torch.empty(1, dtype=dtype).expand(*shape)


def is_deferred(t: Any) -> bool:
    """A tensor whose elements share storage (no real weight does)."""
    return isinstance(t, torch.Tensor) and any(
        stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape))


def materialize(param: torch.Tensor) -> None:
    """A deferred stack's own storage, in place (the same Parameter: loaders keep it)."""
    if is_deferred(param):
        param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)


def deferred_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of the FusedMoE layers still holding a deferred stack."""
    for name, m in model.named_modules():
        if any(is_deferred(getattr(m, s, None)) for s in STACKS):
            yield name, m


def check_none_deferred(model: nn.Module) -> None:
    """After a load: a deferred stack left means experts that never arrived (they would
    compute with one shared garbage value)."""
    left = [name for name, _ in deferred_layers(model)]
    if left:
        raise ValueError(f"MoE experts of {len(left)} layer(s) (e.g. {left[0]!r}) received "
                         "neither packed nor dense weights")

"""Sibling linears that read one input (q/k/v, gate/up) run as one GEMM.

transformers' modules call q_proj(x), k_proj(x), v_proj(x) one after the other: three GEMVs
per decode step where shoal's own layers run one. Which siblings share their input is seen
on the construction-time probe pass (each plain nn.Linear's input tensor, by identity), not
read from names. Their weights are then moved into one packed tensor, each member's
parameter a row-slice view of it: names, shapes and the checkpoint loader are unchanged, and
anything that writes a member's parameter in place (a load, a weight update through the
lifecycle, a sleep's storage restore) writes the packed tensor. The first member called with
a new input runs the packed GEMM; the others called with that same tensor take their columns
of its output. A member called with any other tensor, or whose parameter no longer views the
packed tensor (something re-pointed it), runs its own F.linear: always the same result."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class PackedGroup:
    """The packed weight (and bias) of sibling linears, and the last input's output until
    every member has taken its columns."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        self.weight, self.bias, self.sizes = weight, bias, sizes
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._waiting: set[int] = set()

    def packed_output(self, x: torch.Tensor) -> torch.Tensor:
        """F.linear(x, packed weight, packed bias): every member's output, side by side."""
        return F.linear(x, self.weight, self.bias)

    def columns(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input:
            self._input, self._output = x, self.packed_output(x)
            self._waiting = set(range(len(self.sizes)))
        assert self._output is not None
        out = self._output.narrow(-1, self.offsets[index], self.sizes[index])
        self._waiting.discard(index)
        if not self._waiting:  # (holds no step's tensors past its last member)
            self._input = self._output = None
        return out


class PackedMemberLinear(nn.Linear):
    """An nn.Linear whose weight (and bias) view a PackedGroup's packed tensors."""

    group: PackedGroup
    index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.still_packed():
            return self.group.columns(self.index, x)
        return F.linear(x, self.weight, self.bias)

    def still_packed(self) -> bool:
        g, first = self.group, self.group.offsets[self.index]
        w = g.weight
        if self.weight.data_ptr() != w.data_ptr() + first * w.stride(0) * w.element_size():
            return False
        b = g.bias
        return self.bias is None or (b is not None and self.bias.data_ptr()
                                     == b.data_ptr() + first * b.element_size())


@contextmanager
def linear_inputs(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """id(linear) -> the input it was called with, for the plain nn.Linear modules of `model`
    called inside (the probe pass): the first input of each, held until the context exits."""
    seen: dict[int, torch.Tensor] = {}

    def hook(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            seen.setdefault(id(module), args[0])

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()
               if type(m) is nn.Linear]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def pack_shared_input_linears(model: nn.Module, inputs: dict[int, torch.Tensor]
                              ) -> list[list[str]]:
    """Packs each set of two or more sibling nn.Linear modules (children of one module, same
    input features, dtype, device and bias presence) that the probe saw called with one
    input tensor. Their parameters must not yet hold weights (construction: zeros), since
    the packed tensor starts from zeros. Returns the packed groups' module names."""
    names = {id(m): n for n, m in model.named_modules()}
    packed = []
    for parent in list(model.modules()):
        by_input: dict[tuple, list[tuple[str, nn.Linear]]] = {}
        for name, child in parent.named_children():
            x = inputs.get(id(child))
            if x is None or type(child) is not nn.Linear:
                continue
            w = child.weight
            key = (id(x), w.shape[1], w.dtype, w.device, child.bias is not None)
            by_input.setdefault(key, []).append((name, child))
        for members in by_input.values():
            if len(members) > 1 and _not_shared(model, [m for _, m in members]):
                _pack(parent, members)
                packed.append([f"{names[id(parent)]}.{n}".lstrip(".") for n, _ in members])
    return packed


def _not_shared(model: nn.Module, linears: list[nn.Linear]) -> bool:
    """No member's parameter is also another module's (tied): packing would untie it."""
    own = {id(p) for m in linears for p in m.parameters(recurse=False)}
    uses = sum(1 for m in model.modules() for p in m.parameters(recurse=False)
               if id(p) in own)
    return uses == len(own)


def _pack(parent: nn.Module, members: list[tuple[str, nn.Linear]]) -> None:
    first = members[0][1]
    sizes = [m.out_features for _, m in members]
    w = first.weight
    weight = torch.zeros(sum(sizes), w.shape[1], dtype=w.dtype, device=w.device)
    bias = (torch.zeros(sum(sizes), dtype=first.bias.dtype, device=w.device)
            if first.bias is not None else None)
    group = PackedGroup(weight, bias, sizes)
    for index, (name, m) in enumerate(members):
        lo, n = group.offsets[index], sizes[index]
        new = PackedMemberLinear.__new__(PackedMemberLinear)
        nn.Module.__init__(new)
        new.in_features, new.out_features = m.in_features, m.out_features
        new.weight = nn.Parameter(weight[lo:lo + n], requires_grad=False)
        new.register_parameter("bias", nn.Parameter(bias[lo:lo + n], requires_grad=False)
                               if bias is not None else None)
        new.group, new.index = group, index
        new.train(m.training)
        setattr(parent, name, new)

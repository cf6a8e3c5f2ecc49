"""Packed linears through the models' own weight loaders.

The weight stream yields, for each linear it leaves packed, a stand-in for its dense weight:
a tensor of the dense shape [N, K] and the model's dtype that owns no data of its own
(a column [N, 1] expanded over K, so that a model's row slice of it keeps its offset). Each
model routes it as it routes a dense weight: renamed into a fused layer, handed to the
parameter's weight_loader with a shard id. `PackedLoading` has swapped every parameter's
loader for one that recognises a stand-in (by its storage) and calls the original loader
once per packed part instead, on a buffer of the layer's rows: since every part has the
output rows first, the loader puts each part's rows where it would have put the weight's.

A stand-in that reaches a layer that cannot run packed (not a shoal linear, a weight read
as a tensor, a shard whose parts disagree with the layer's others) is dequantized there and
loaded dense. One that no loader ever sees (a model that copies or reshapes weights itself)
is an error at the end of the load, never garbage in a layer.

FusedMoE layers (`experts`) take FP8 and INT4 experts the same way: their w13_weight /
w2_weight [E, rows, K] get part buffers [E, rows, ...] that FusedMoE's own loader fills expert
by expert and shard by shard (gate / up rows, this rank's down columns); act-order INT4 (a
permutation of the inputs per expert), and a rank's share of the down inputs that is not
whole scale groups, are dequantized there (`refused` says why, for the log)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shoal.quantization.packed import PackedLinear, dequantize_packed


@dataclass
class _Entry:
    module: str
    packed: PackedLinear | None
    base: torch.Tensor  # the stand-in's storage, held so that its address is not reused
    taken: bool = False


class StandIns:
    """The stand-ins of one load pass, by the address of their storage."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._entries: dict[int, _Entry] = {}

    def make(self, module: str, packed: PackedLinear) -> torch.Tensor:
        base = torch.empty(packed.out_features, 1, dtype=self.dtype)
        self._entries[base.untyped_storage().data_ptr()] = _Entry(module, packed, base)
        return base.expand(-1, packed.in_features)

    def take(self, t: torch.Tensor) -> tuple[str, PackedLinear] | None:
        """The module and rows a (slice of a) stand-in stands for; None for a real tensor."""
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.stride(1) != 0:
            return None
        entry = self._entries.get(t.untyped_storage().data_ptr())
        if entry is None or entry.packed is None:
            return None
        entry.taken = True
        p = entry.packed
        if t.shape[1] != p.in_features:
            raise ValueError(f"{entry.module}: a model sliced the inputs of a packed weight")
        start, rows = t.storage_offset(), t.shape[0]
        return entry.module, p if (start, rows) == (0, p.out_features) else p.rows(start, rows)

    def untaken(self) -> list[str]:
        return [e.module for e in self._entries.values() if not e.taken]

    def release(self) -> None:
        self._entries.clear()


@dataclass
class LayerParts:
    """A layer's packed parts as its loader placed them ([rows of the layer, ...] each; an
    expert stack's [E, rows, ...])."""

    kind: str
    group: int
    in_features: int  # this rank's K
    split: int  # inputs of the checkpoint tensor over the layer's (row-parallel ranks)
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    present: torch.Tensor | None = None  # uint8 [(E,) rows, 1]: rows a packed shard filled
    perm: torch.Tensor | None = None
    mixed: bool = False  # some shard came dense: the layer stays dense

    def packed(self) -> PackedLinear:
        return PackedLinear(self.kind, self.in_features, self.group, self.parts, self.perm)


# An expert stack's parts are keyed by (FusedMoE layer, "w13" or "w2").
ExpertKey = tuple[nn.Module, str]


class PackedLoading:
    """Swaps every parameter's weight_loader while a model loads (`with` block); `layers`:
    the linear layers that may run packed, `experts`: the FusedMoE layers that may."""

    def __init__(self, model: nn.Module, stand_ins: StandIns, layers: set[nn.Module],
                 experts: set[nn.Module] | None = None):
        self.model, self.stand_ins, self.fast = model, stand_ins, layers
        self.experts = experts or set()
        self.parts: dict[nn.Module, LayerParts] = {}
        self.expert_parts: dict[ExpertKey, LayerParts] = {}
        self.refused: dict[nn.Module, str] = {}  # expert layers with a dequantized shard: why
        self.expert_kinds: dict[nn.Module, str] = {}  # expert layers: the packed kind seen
        self._saved: list[tuple[nn.Parameter, Any]] = []

    def __enter__(self) -> PackedLoading:
        from shoal.layers.linear import default_weight_loader

        owner: dict[int, nn.Module | ExpertKey] = {id(m.weight): m for m in self.fast}
        for m in self.experts:
            owner[id(m.w13_weight)], owner[id(m.w2_weight)] = (m, "w13"), (m, "w2")
        for _, param in self.model.named_parameters():
            orig = getattr(param, "weight_loader", None)
            self._saved.append((param, orig))
            param.weight_loader = functools.partial(
                self._load, owner.get(id(param)), orig or default_weight_loader)
        return self

    def __exit__(self, *exc: object) -> None:
        for param, orig in self._saved:
            if orig is None:
                del param.weight_loader
            else:
                param.weight_loader = orig
        self._saved.clear()

    def _load(self, owner: nn.Module | ExpertKey | None, orig: Any, param: torch.Tensor,
              loaded: torch.Tensor, *args: Any, **kw: Any) -> None:
        found = self.stand_ins.take(loaded)
        if found is None:
            return orig(param, loaded, *args, **kw)
        module, packed = found
        if isinstance(owner, tuple):
            table: dict = self.expert_parts
            target = self._expert_parts_for(owner, param, packed)
        else:
            table = self.parts
            target = self._parts_for(owner, param, packed, table)
        if target is None:
            dense = dequantize_packed(packed).to(param.dtype)
            if owner in table:
                table[owner].mixed = True
            return orig(param, dense, *args, **kw)
        for name, part in packed.parts.items():
            src = part if part.shape[1] > 1 or target.split == 1 else \
                part.expand(-1, target.split)
            orig(target.parts[name], src.to(target.parts[name].device), *args, **kw)
        ones = torch.ones(packed.out_features, target.split, dtype=torch.uint8)
        orig(target.present, ones, *args, **kw)

    def _expert_parts_for(self, owner: ExpertKey, param: torch.Tensor,
                          p: PackedLinear) -> LayerParts | None:
        self.expert_kinds.setdefault(owner[0], p.kind)
        if p.kind not in ("fp8", "int4"):
            self.refused.setdefault(owner[0], f"{p.kind} experts have no kernel here")
            return None
        if p.perm is not None:
            self.refused.setdefault(owner[0], "act-order int4 experts (inputs permuted per "
                                    "expert) have no kernel here")
            return None
        target = self._parts_for(owner, param, p, self.expert_parts)
        if target is None:
            self.refused.setdefault(owner[0], "a rank's share of the expert inputs is not "
                                    "whole scale groups, or the experts' layouts differ")
        return target

    def _parts_for(self, key: nn.Module | ExpertKey | None, param: torch.Tensor,
                   p: PackedLinear, table: dict) -> LayerParts | None:
        """The layer's buffers, made for this first shard; None when it cannot take `p`."""
        dims = 3 if isinstance(key, tuple) else 2
        if key is None or param.dim() != dims or p.in_features % param.shape[-1]:
            return None
        split = p.in_features // param.shape[-1]
        k = param.shape[-1]
        if split > 1 and (p.perm is not None or p.group % 8 or
                          (p.group < p.in_features and k % p.group)):
            return None  # a rank's inputs must be whole words and groups
        cols = {name: t.shape[1] for name, t in p.parts.items()}
        if any(c > 1 and c % split for c in cols.values()):
            return None
        have = table.get(key)
        if have is not None:
            same = (have.kind == p.kind and have.group == p.group and have.split == split
                    and all(have.parts[n].shape[-1] * (split if c > 1 else 1) == c
                            for n, c in cols.items() if n in have.parts)
                    and set(have.parts) == set(cols)
                    and (have.perm is None) == (p.perm is None)
                    and (p.perm is None or torch.equal(have.perm, p.perm)))
            return have if same else None
        rows, device = param.shape[:-1], param.device  # [N] or [E, N]
        parts = {name: torch.zeros(*rows, max(c // split, 1), dtype=t.dtype, device=device)
                 for (name, t), c in zip(p.parts.items(), cols.values())}
        made = LayerParts(p.kind, p.group, k, split, parts,
                          torch.zeros(*rows, 1, dtype=torch.uint8, device=device), p.perm)
        table[key] = made
        return made

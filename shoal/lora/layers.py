"""LoRA on the model's projections: each adaptable linear layer gets a LoRALayer holding
`max_loras` adapter slots as fixed tensors (A stacked over the layer's fused sub-projections,
B scaled), and adds B A x of each token's slot to the layer's output, before a row-parallel
layer's all-reduce (the partial products sum to the whole) and before a column-parallel
layer's gather. The slot of every token of the step is one shared tensor (LoRAStep), so a
CUDA graph replays with whatever slots the step wrote there.

Which layers: the column- and row-parallel projections under `model.layers.` whose
checkpoint names end in q/k/v/o_proj or gate/up/down_proj (fused qkv_proj and gate_up_proj
through the model's packed_modules_mapping), on the architectures of
shoal.config.lora.LORA_ARCHITECTURES, whose projections see every token of the step, less
those the lora_target_modules setting leaves out (shoal/lora/target_modules.py). The routed
experts of their MoE layers take adapters through shoal/lora/expert_layers.py.

What a model class may say of its checkpoint's names (class attributes, none by default):
`lora_extra_leaves`, more module names that take adapters (StarCoder2's c_fc, c_proj);
`lora_fused_modules`, fused layers that are one module in the checkpoint too (Phi-3's qkv_proj
and gate_up_proj): an adapter of it has one A and one B over all the parts' rows, each part
reads its rows of B (A repeats in each part's block); and `adapt_lora_b(module, b)`, a B
[out, r] with its rows reordered as the model reorders the module's weight rows at load
(GLM-4's and Cohere's interleaved rotary)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shoal.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    SegmentedColumnLinear,
)
from shoal.lora.ops import add_lora
from shoal.lora.ops.lora_groups import (
    SlotGroup,
    add_lora_groups,
    block_diagonal,
    group_tokens,
)
from shoal.lora.target_modules import wants_layer

TARGET_LEAVES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"})


class LoRAStep:
    """The step's token -> slot table (-1: no adapter), shared by every LoRA layer."""

    def __init__(self, max_tokens: int, device: torch.device, use_triton: bool):
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.num_tokens = 0  # rows written by the last set()
        self.active = False  # some token of the step has an adapter
        self.groups: list[SlotGroup] = []  # the CPU path's tokens by adapter
        # CUDA: the kernels always run (a captured graph must hold them whatever the step)
        self.use_triton = use_triton

    def set(self, slots: list[int]) -> None:
        n, prev = len(slots), self.num_tokens
        if n > self.token_slots.shape[0]:
            raise ValueError(f"a step of {n} tokens; the LoRA slot table holds "
                             f"{self.token_slots.shape[0]}")
        self.active = any(s >= 0 for s in slots)
        if not self.use_triton:
            self.groups = group_tokens(slots) if self.active else []
        if n:
            src = torch.tensor(slots, dtype=torch.int32)
            self.token_slots[:n].copy_(src, non_blocking=True)
        if prev > n:  # graph padding rows read past n: no adapter there
            self.token_slots[n:prev].fill_(-1)
        self.num_tokens = n


@dataclass(frozen=True)
class SubProjection:
    """One checkpoint projection inside a (possibly fused) layer, on this rank."""

    name: str  # the checkpoint module name, e.g. model.layers.0.self_attn.k_proj
    out_offset: int  # its first output row in the layer (this rank's rows)
    out_size: int  # its rows on this rank
    out_start: int  # the first row of the full B this rank takes
    full_out: int
    in_start: int  # the first column of the full A this rank takes (row-parallel)
    in_size: int
    full_in: int


class LoRALayer:
    """A projection's adapter slots (plain tensors, not module state: no checkpoint name)."""

    def __init__(self, subs: list[SubProjection], out_local: int, step: LoRAStep,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 adapt_b: Callable[[str, torch.Tensor], torch.Tensor] | None = None):
        self.subs, self.step, self.rank = subs, step, max_rank
        self.adapt_b = adapt_b  # the model's adapt_lora_b, if any
        in_local = subs[0].in_size
        self.a = torch.zeros(max_loras, len(subs) * max_rank, in_local, dtype=dtype,
                             device=device)
        self.b = torch.zeros(max_loras, out_local, max_rank, dtype=dtype, device=device)
        self.sub_offsets = tuple(s.out_offset for s in subs)
        # the CPU path's B, block-diagonal over the sub-projections (lora_groups.py)
        self.b_full = (None if step.use_triton else
                       torch.zeros(max_loras, out_local, len(subs) * max_rank, dtype=dtype,
                                   device=device))

    def write_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
                   ) -> None:
        """Slot `slot` <- the adapter's (A [r, in], B [out, r] scaled) per checkpoint module
        name (full, unsharded tensors); zero for the sub-projections it does not adapt."""
        r = self.rank
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, sub in enumerate(self.subs):
            pair = weights.get(sub.name)
            if pair is None:
                continue
            a, b = pair
            if self.adapt_b is not None:
                b = self.adapt_b(sub.name, b)
            rank = a.shape[0]
            # non_blocking: queued behind the steps already launched (stream order), without
            # a host wait per copy (~450 of them an 8B adapter); torch keeps a pinned
            # source's memory until its copy is done, and copies a pageable one before
            # returning
            self.a[slot, i * r:i * r + rank].copy_(a[:, sub.in_start:sub.in_start + sub.in_size],
                                                   non_blocking=True)
            self.b[slot, sub.out_offset:sub.out_offset + sub.out_size, :rank].copy_(
                b[sub.out_start:sub.out_start + sub.out_size], non_blocking=True)
        if self.b_full is not None:
            self.b_full[slot] = block_diagonal(self.b[slot], self.sub_offsets, r)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += B[slot] A[slot] x for each token (in place)."""
        step = self.step
        if not (step.active or step.use_triton):
            return
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if self.b_full is not None:
            if x2.shape[0] != step.num_tokens:
                raise RuntimeError(f"a LoRA layer ran on {x2.shape[0]} rows in a step of "
                                   f"{step.num_tokens} tokens")
            add_lora_groups(y2, x2, self.a, self.b_full, step.groups)
            return
        add_lora(y2, x2, self.a, self.b, step.token_slots[:x2.shape[0]], self.sub_offsets,
                 self.rank, use_triton=step.use_triton)


def _fused_subs(model: nn.Module) -> dict[str, list[tuple[str, object]]]:
    """Fused parameter name -> its checkpoint projections and shard ids, in order."""
    fused: dict[str, list[tuple[str, object]]] = {}
    for src, (dst, shard) in getattr(model, "packed_modules_mapping", {}).items():
        fused.setdefault(dst, []).append((src, shard))
    order = {"q": 0, "k": 1, "v": 2}
    for subs in fused.values():
        subs.sort(key=lambda s: order.get(s[1], s[1]) if isinstance(s[1], str) else s[1])
    return fused


def _subs_of(name: str, layer: nn.Module, fused: dict[str, list[tuple[str, object]]],
             leaves: frozenset[str], whole: frozenset[str]) -> list[SubProjection] | None:
    """leaves: the checkpoint module names that take adapters; whole: the fused layers
    adapted as one checkpoint module (the module docstring)."""
    prefix, leaf = name.rsplit(".", 1)
    if isinstance(layer, RowParallelLinear):
        if leaf not in leaves:
            return None
        out, in_local = layer.weight.shape
        return [SubProjection(name, 0, out, 0, out, layer.tp_rank * in_local, in_local,
                              in_local * layer.tp_size)]
    if isinstance(layer, SegmentedColumnLinear) or not isinstance(layer, ColumnParallelLinear):
        return None
    tp, rank, hidden = layer.tp_size, layer.tp_rank, layer.input_size
    if isinstance(layer, QKVParallelLinear):
        names = [src for src, _ in fused.get(leaf, [])]
        if len(names) != 3:
            return None
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        kv_rank = rank // layer.kv_replicas
        full_kv = kv * tp // layer.kv_replicas
        parts = [(q, rank * q, q * tp), (kv, kv_rank * kv, full_kv), (kv, kv_rank * kv, full_kv)]
    elif isinstance(layer, MergedColumnParallelLinear):
        names = [src for src, _ in fused.get(leaf, [])]
        if len(names) != len(layer.output_sizes):
            return None
        parts = [(n // tp, rank * (n // tp), n) for n in layer.output_sizes]
    else:
        names = [leaf]
        out = layer.output_size_per_partition
        parts = [(out, rank * out, out * tp)]
    if leaf in whole and len(parts) > 1:
        # one checkpoint module: part j's rows of its B start after the parts before it
        total, subs, offset, before = sum(p[2] for p in parts), [], 0, 0
        for size, start, full in parts:
            subs.append(SubProjection(name, offset, size, before + start, total, 0, hidden,
                                      hidden))
            offset, before = offset + size, before + full
        return subs
    if not all(n in leaves for n in names):
        return None
    subs, offset = [], 0
    for src, (size, start, full) in zip(names, parts):
        subs.append(SubProjection(f"{prefix}.{src}", offset, size, start, full, 0, hidden,
                                  hidden))
        offset += size
    return subs


@dataclass(frozen=True)
class AdaptedProjections:
    layers: list[LoRALayer]
    # the checkpoint leaf names of the adaptable projections target_modules left out
    left_out: frozenset[str]
    # every leaf name target_modules may list (the parts' and the fused layers')
    names: frozenset[str]


def fused_parts(model: nn.Module) -> dict[str, list[str]]:
    """Fused layer leaf -> its checkpoint parts' leaves (qkv_proj -> q_proj, k_proj, v_proj)."""
    return {dst: [src for src, _ in subs] for dst, subs in _fused_subs(model).items()}


def add_lora_layers(model: nn.Module, step: LoRAStep, max_loras: int, max_rank: int,
                    dtype: torch.dtype, device: torch.device,
                    targets: frozenset[str] | None = None) -> AdaptedProjections:
    """Gives every adaptable projection that `targets` (target_modules.expand's; None:
    all) wants its LoRALayer (layer.lora)."""
    fused = _fused_subs(model)
    leaves = TARGET_LEAVES | frozenset(getattr(model, "lora_extra_leaves", ()))
    whole = frozenset(getattr(model, "lora_fused_modules", ()))
    adapt_b = getattr(model, "adapt_lora_b", None)
    layers: list[LoRALayer] = []
    left_out: set[str] = set()
    names: set[str] = set()
    for name, module in model.named_modules():
        if not name.startswith("model.layers.") or getattr(module, "lora", None) is not None:
            continue
        subs = _subs_of(name, module, fused, leaves, whole)
        if subs is None:
            continue
        parts = {s.name.rsplit(".", 1)[-1] for s in subs}
        layer_names = parts | {name.rsplit(".", 1)[-1]}
        names |= layer_names
        if not wants_layer(targets, layer_names):
            left_out |= parts
            continue
        out_local = module.weight.shape[0]
        lora = LoRALayer(subs, out_local, step, max_loras, max_rank, dtype, device, adapt_b)
        module.lora = lora
        layers.append(lora)
    return AdaptedProjections(layers, frozenset(left_out), frozenset(names))


def lora_targets(layers: list[LoRALayer]) -> dict[str, tuple[int, int]]:
    """Checkpoint module name -> (in_features, out_features) of every adaptable projection."""
    return {s.name: (s.full_in, s.full_out) for layer in layers for s in layer.subs}

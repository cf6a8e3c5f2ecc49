"""LoRA on the routed experts of a FusedMoE layer: `max_loras` adapter slots of every local
expert as fixed tensors, and the hook FusedMoE's expert paths call (layer.lora) to add each
(token, expert) pair's delta: its token's adapter, that adapter's A and B of that expert.

Slots, per layer (this rank's experts and intermediate rows, as FusedMoE holds them):
a13 [S, E, 2R, H] and b13 [S, E, 2I, 2R] for the gate|up projection (2R: PEFT's stacked
gate_up_proj adapter has rank 2r when converted from gate_proj + up_proj targets; per-expert
gate_proj and up_proj adapters take columns 0:R and R:2R of a block-diagonal B), a2 [S, E, R, I]
and b2 [S, E, H, R] for down_proj; B scaled. A pair of token t and local expert e reads slot
row s * E + e of the flattened buffers, s = the token's slot: the batched op of
shoal.lora.ops (torch or Triton) does the rest, the pairs grouped by (adapter, expert).

Under DP+EP (the layer's FusedMoE has a dispatch_group) the slots are the replicas' shared
table (shared_expert_slots.py: data_parallel_size * max_loras of them), filled with the
slices of this replica's experts: the token's shared slot travels with its pairs in the
all-to-all (dispatched), and the owner's expert path adds the delta through for_rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.layers.moe.layer import FusedMoE
from shoal.lora.expert_adapter import PER_EXPERT
from shoal.lora.layers import LoRAStep
from shoal.lora.ops import add_lora
from shoal.lora.shared_expert_slots import SharedExpertSlots

Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]


class ExpertLoRA:
    """One FusedMoE's expert adapter slots (plain tensors, not module state)."""

    def __init__(self, name: str, moe: FusedMoE, step: LoRAStep, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device):
        self.name, self.step, self.rank = name, step, max_rank
        self.num_experts, self.local = moe.num_experts, moe.local_num_experts
        self.expert_start = moe.expert_start
        self.hidden, self.inter = moe.hidden_size, moe.inter
        self.inter_start = moe.inter_rank * moe.inter  # this rank's first intermediate row
        self.full_inter = moe.inter * (moe.tp_size if moe.ep_size == 1 else 1)
        s, e, h, i, r = max_loras, self.local, self.hidden, self.inter, max_rank

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.a13, self.b13 = zeros(s, e, 2 * r, h), zeros(s, e, 2 * i, 2 * r)
        self.a2, self.b2 = zeros(s, e, r, i), zeros(s, e, h, r)
        self.shared: SharedExpertSlots | None = None  # DP+EP: the replicas' slot table

    @property
    def nbytes(self) -> int:
        """The device memory of its slots (expert_slot_bytes' figure, measured)."""
        return sum(t.numel() * t.element_size() for t in (self.a13, self.b13, self.a2, self.b2))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(num_experts, hidden, moe_intermediate_size) of the full layer."""
        return self.num_experts, self.hidden, self.full_inter

    def enabled(self) -> bool:
        """Whether the step needs the hook (on CUDA always: a graph holds its kernels)."""
        return self.step.active or self.step.use_triton

    # ---- the forward hook ---------------------------------------------------------------------
    def add(self, which: str, y: torch.Tensor, x: torch.Tensor, experts: int | torch.Tensor,
            tokens: torch.Tensor | None) -> None:
        """y [N, out] += each row's delta: x [N, in] the rows' inputs to projection `which`
        ("w13": gate|up, "w2": down) of local expert `experts` (one for all rows, or one per
        row), rows of step tokens `tokens` (None: row i is token i)."""
        self.add_rows(self.step.token_slots, which, y, x, experts, tokens)

    def add_rows(self, table: torch.Tensor, which: str, y: torch.Tensor, x: torch.Tensor,
                 experts: int | torch.Tensor, tokens: torch.Tensor | None) -> None:
        """add, with `table` giving the slot of each token (row) the tokens index."""
        slots = table[:y.shape[0]] if tokens is None else table[tokens]
        pair = torch.where(slots >= 0, slots.long() * self.local + experts, -1)
        a, b = (self.a13, self.b13) if which == "w13" else (self.a2, self.b2)
        add_lora(y, x, a.flatten(0, 1), b.flatten(0, 1), pair, (0,), a.shape[2],
                 use_triton=self.step.use_triton)

    # ---- DP+EP: slots that travel with the tokens ---------------------------------------------
    def dispatched(self, num_tokens: int) -> torch.Tensor | None:
        """The shared slots [num_tokens] of this replica's step tokens, to send beside them
        in the all-to-all; None where none travel (no DP+EP, or no adapter on any replica:
        alike on every replica)."""
        return None if self.shared is None else self.shared.dispatched(num_tokens)

    def for_rows(self, slots: torch.Tensor) -> ReceivedRows:
        """The hook for rows the all-to-all brought here, row i of slot slots[i]."""
        return ReceivedRows(self, slots)

    # ---- slots --------------------------------------------------------------------------------
    def write_slot(self, slot: int, weights: Weights) -> None:
        """Slot `slot` <- the adapter's expert tensors of this layer (full, unsharded; B
        scaled), zero where it adapts none."""
        for t in (self.a13, self.b13, self.a2, self.b2):
            t[slot].zero_()
        experts = slice(self.expert_start, self.expert_start + self.local)
        rows = slice(self.inter_start, self.inter_start + self.inter)
        if (pair := weights.get(f"{self.name}.gate_up_proj")) is not None:
            a, b = _per_expert(*pair, self.num_experts)
            r, full = a.shape[1], b.shape[1] // 2
            self.a13[slot, :, :r] = a[experts]
            up = slice(full + rows.start, full + rows.stop)
            self.b13[slot, :, :, :r] = torch.cat([b[experts, rows], b[experts, up]], dim=1)
        if (pair := weights.get(f"{self.name}.down_proj")) is not None:
            a, b = _per_expert(*pair, self.num_experts)
            r = a.shape[1]
            self.a2[slot, :, :r] = a[experts, :, rows]
            self.b2[slot, :, :, :r] = b[experts]
        for i in range(self.local):
            self._write_expert(slot, i, self.expert_start + i, rows, weights)

    def _write_expert(self, slot: int, i: int, e: int, rows: slice, weights: Weights) -> None:
        """Local expert i (global e) <- its per-expert gate, up and down adapters."""
        r, n = self.rank, self.inter
        for leaf, proj in PER_EXPERT.items():
            pair = weights.get(f"{self.name}.{e}.{leaf}")
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            if proj == "down":
                self.a2[slot, i, :rank] = a[:, rows]
                self.b2[slot, i, :, :rank] = b
                continue
            col, out = (0, 0) if proj == "gate" else (r, n)
            self.a13[slot, i, col:col + rank] = a
            self.b13[slot, i, out:out + n, col:col + rank] = b[rows]


def _per_expert(a: torch.Tensor, b: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's stacked pair, A [E * r, in] and B [out, E * r] -> A [E, r, in], B [E, out, r]."""
    r = a.shape[0] // num_experts
    return (a.view(num_experts, r, a.shape[1]),
            b.view(b.shape[0], r, num_experts).permute(2, 0, 1))


class ReceivedRows:
    """FusedMoE's LoRA hook over rows dispatched to this replica (all_to_all.py): the slot of
    row i is slots[i], sent by the token's replica (the shared table's numbering)."""

    def __init__(self, lora: ExpertLoRA, slots: torch.Tensor):
        self.lora, self.slots = lora, slots

    def add(self, which: str, y: torch.Tensor, x: torch.Tensor, experts: int | torch.Tensor,
            tokens: torch.Tensor | None) -> None:
        self.lora.add_rows(self.slots, which, y, x, experts, tokens)


def moe_layers(model: nn.Module) -> list[tuple[str, FusedMoE]]:
    """The FusedMoE layers of the decoder layers (they all take expert adapters)."""
    return [(name, module) for name, module in model.named_modules()
            if name.startswith("model.layers.") and isinstance(module, FusedMoE)]


def dispatch_group(model: nn.Module) -> Any:
    """DP+EP: the group the model's MoE layers dispatch tokens over; None otherwise."""
    return next((m.dispatch_group for _, m in moe_layers(model)
                 if m.dispatch_group is not None), None)


def add_expert_lora(model: nn.Module, step: LoRAStep, num_slots: int, max_rank: int,
                    dtype: torch.dtype, device: torch.device) -> list[ExpertLoRA]:
    """Gives every FusedMoE of moe_layers its ExpertLoRA of num_slots slots (max_loras;
    data_parallel_size times that under DP+EP); returns them."""
    layers = []
    for name, module in moe_layers(model):
        module.lora = ExpertLoRA(name, module, step, num_slots, max_rank, dtype, device)
        layers.append(module.lora)
    return layers


def expert_slot_bytes(num_layers: int, local_experts: int, hidden: int, inter: int,
                      max_loras: int, max_rank: int, dtype_bytes: int) -> int:
    """The device memory of the expert slots ExpertLoRA allocates (a13, b13, a2, b2 of
    every layer), without building them: local_experts and inter as one rank holds them
    (max_loras: the slots, data_parallel_size * max_loras under DP+EP)."""
    per_expert = 2 * max_rank * hidden + 2 * inter * 2 * max_rank + max_rank * inter \
        + hidden * max_rank
    return num_layers * max_loras * local_experts * per_expert * dtype_bytes


def expert_targets(layers: list[ExpertLoRA]) -> dict[str, tuple[int, int, int]]:
    """LoRALimits.experts: experts module name -> (num_experts, hidden, intermediate)."""
    return {layer.name: layer.shape for layer in layers}

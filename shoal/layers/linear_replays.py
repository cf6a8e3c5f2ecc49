"""Where linear-attention layers keep a verify step's inputs until the next step folds the
accepted run into the state (ReplaySSM: shoal/attention/linear_state.py).

Each layer holds one persistent buffer (KeptInputs), a row of `tokens` x its replay_width
values per slot, so a CUDA graph reads and writes it by slot index. Slot 0 is the trash row
that padding and rows with nothing to keep write; requests get slots 1..capacity.

ReplaySlots (host side, one per runner) says which slot holds a request's inputs: it takes a
slot when the request verifies and gives it back once a later step of the request has folded
them in, or when the request ends or comes back after preemption. A step holds at most
capacity (max_num_seqs) requests, but requests preempted right after a verify keep their
slot until they return; when a step finds no free slot, the inputs of a request outside the
step move to a spare device copy (spilled) and come back into a slot when it next runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from shoal.attention.linear_state import TRASH_SLOT


class KeptInputs:
    def __init__(self, slots: int, tokens: int, width: int, dtype: torch.dtype,
                 device: torch.device):
        """slots requests (plus the trash row) of up to `tokens` tokens of `width` values."""
        self.tokens, self.width = tokens, width
        # zeros: rows never written are finite (padding reads them, then masks them out)
        self.buffer = torch.zeros(slots + 1, tokens, width, dtype=dtype, device=device)

    def pack(self, x: torch.Tensor, rest: Sequence[torch.Tensor]) -> torch.Tensor:
        """x [..., C] and rest [..., *s] (the same leading dims) as [..., width]."""
        lead = x.shape[:-1]
        packed = torch.cat([x, *(r.reshape(*lead, -1).to(x.dtype) for r in rest)], dim=-1)
        if packed.shape[-1] != self.width:
            raise ValueError(f"a token's conv input and rest hold {packed.shape[-1]} values; "
                             f"the layer keeps replay_width={self.width}")
        return packed.to(self.buffer.dtype)

    def unpack(self, packed: torch.Tensor, like: tuple[torch.Tensor, Sequence[torch.Tensor]]
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """packed [..., width] back into x and rest shaped and typed as `like`'s per token
        (like: a step's x [n, C] and rest [n, *s])."""
        x, rest = like
        lead = packed.shape[:-1]
        parts = packed.split([x.shape[-1], *(r[0].numel() for r in rest)], dim=-1)
        return (parts[0].to(x.dtype),
                tuple(p.reshape(*lead, *r.shape[1:]).to(r.dtype) for p, r in zip(parts[1:], rest)))

    def keep(self, slots: torch.Tensor, packed: torch.Tensor) -> None:
        """Rows' packed inputs [R, T, width] (T <= tokens) into their slots [R] (device)."""
        self.buffer.narrow(1, 0, packed.shape[1]).index_copy_(0, slots, packed)

    def keep_one(self, slot: int, packed: torch.Tensor) -> None:
        """One request's packed inputs [n, width] (an eager verify step)."""
        if packed.shape[0] > self.tokens:
            raise ValueError(f"a verify of {packed.shape[0]} tokens does not fit the "
                             f"{self.tokens} kept per request (num_speculative_tokens + 1)")
        self.buffer[slot, :packed.shape[0]].copy_(packed)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """[R, tokens, width]: the inputs kept in slots [R] (device)."""
        return self.buffer.index_select(0, slots)


class KeepsInputs(Protocol):
    kept: KeptInputs | None


class ReplaySlots:
    def __init__(self, capacity: int, layers: Sequence[KeepsInputs]):
        """capacity: the most requests one step holds (max_num_seqs); layers: whose
        KeptInputs the slots index."""
        if capacity < 1:
            raise ValueError(f"ReplaySlots capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.layers = list(layers)
        self._slot: dict[int, int] = {}  # serial -> slot, in the order taken
        self._free = list(range(capacity, 0, -1))
        self._spilled: dict[int, list[torch.Tensor]] = {}  # serial -> each layer's row

    def assign(self, serials: Sequence[int], replays: Sequence[int],
               verifies: Sequence[bool]) -> list[int]:
        """A step's slots, one per request: the slot its replay reads (replays[i] > 0) and
        its verify keeps into (the same one), else TRASH_SLOT. Requests that fold their
        replay and do not verify give their slot back after this step (a later step's
        writes come after this step's reads on the stream)."""
        step = set(serials)
        out = []
        for serial, replay, verify in zip(serials, replays, verifies):
            slot = self._slot.get(serial)
            if slot is None and replay:
                slot = self._restore(serial, step)
            if slot is None and verify:
                slot = self._take(serial, step)
            out.append(TRASH_SLOT if slot is None else slot)
        for serial, verify in zip(serials, verifies):
            if not verify:
                self._release(serial)
        return out

    def forget(self, serials: set[int]) -> None:
        """Requests that ended or came back after preemption: nothing of theirs is folded."""
        for serial in serials:
            self._release(serial)
            self._spilled.pop(serial, None)

    @property
    def held(self) -> int:
        return len(self._slot)

    def _take(self, serial: int, step: set[int]) -> int:
        if not self._free:
            self._spill(step)
        slot = self._free.pop()
        self._slot[serial] = slot
        return slot

    def _restore(self, serial: int, step: set[int]) -> int:
        rows = self._spilled.pop(serial, None)
        if rows is None:
            raise RuntimeError(f"request serial {serial} folds a verified run in, but no "
                               "linear-attention layer kept its inputs")
        slot = self._take(serial, step)
        for layer, row in zip(self.layers, rows):
            _kept(layer).buffer[slot].copy_(row)
        return slot

    def _spill(self, step: set[int]) -> None:
        """Frees the slot held longest by a request outside this step, its rows copied aside."""
        victim = next((s for s in self._slot if s not in step), None)
        if victim is None:
            raise ValueError(f"a step of {len(step)} requests needs more replay slots than "
                             f"the {self.capacity} kept (max_num_seqs)")
        slot = self._slot.pop(victim)
        self._spilled[victim] = [_kept(layer).buffer[slot].clone() for layer in self.layers]
        self._free.append(slot)

    def _release(self, serial: int) -> None:
        slot = self._slot.pop(serial, None)
        if slot is not None:
            self._free.append(slot)


def _kept(layer: KeepsInputs) -> KeptInputs:
    if layer.kept is None:
        raise RuntimeError("a linear-attention layer has no kept-inputs buffer (its cache is "
                           "not bound)")
    return layer.kept

"""DP+EP: the expert adapter slots numbered alike on every replica.

Why: under DP+EP (shoal/engine/dp_lockstep.py) each replica schedules its own requests and
numbers its dense adapter slots its own way, but the all-to-all (shoal/layers/moe/
all_to_all.py) hands a token's (token, expert) pairs to the replicas owning its experts. The
owner must apply the token's adapter to its own experts, and may never have seen a request of
that adapter. So the expert slots form one table shared by the replicas:

- Before each forward pass (set_step, also a replica's dummy pass) the replicas gather the
  adapters of their steps' tokens (one all_gather_object over the expert-parallel group) and
  each runs the same deterministic assignment on the union: an adapter keeps its slot, a new
  one takes a free slot or the least recently used one no step token needs. Same inputs, same
  order: every replica ends with the same table, and loads the adapters new to it (its own
  experts' slices, read from disk where its host memory lacks them) before the forward pass.
- A token's slot in that table travels beside its hidden state in the all-to-all (only in
  steps where some replica has an adapter: every replica knows from the union), and the
  owner adds the delta of that slot's A and B of its local expert.

An adapter is keyed by (id, folder, digest of its files): two replicas serving two versions of
one id get two slots. Each replica's scheduler admits at most max_loras adapters a step, so the
union never exceeds data_parallel_size * max_loras slots; each replica holds that many slots of
its experts (E / dp of them): the memory of max_loras slots of every expert, as on one rank.
Pins (pin_lora) hold dense slots only; an expert slot is taken when a step needs it.

The replicas must agree on the settings the table depends on: check_same_lora_settings runs
when they join (dp_lockstep.py). A replica that fails to load an adapter makes every replica's
step fail with its message (confirm), not the others' all-to-all wait for it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shoal.config.lora import LoRAConfig
from shoal.lora_request import LoRARequest

Key = tuple[int, str, str]  # (lora_int_id, lora_path, content_digest or "")


def slot_key(lora: LoRARequest) -> Key:
    return lora.lora_int_id, lora.lora_path, lora.content_digest or ""


class SharedExpertSlots:
    """One replica's copy of the table, and its steps' token -> shared slot rows."""

    def __init__(self, num_slots: int, max_tokens: int, group: Any, device: torch.device):
        self.group = group  # the expert-parallel group of the replicas (FusedMoE's dispatch)
        self.in_slot: list[Key | None] = [None] * num_slots
        self.slot_of: dict[Key, int] = {}
        self.last_used = [0] * num_slots
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.num_tokens = 0
        self.active = False  # some replica's step has an adapter: slots travel with tokens
        self._steps = 0

    def agree(self, loras: list[LoRARequest | None]) -> list[tuple[int, LoRARequest]]:
        """A collective: the step's adapters of every replica into the table. Returns the
        (slot, adapter) pairs this step assigned anew, the same on every replica: each loads
        them into its layers' slots before the forward pass."""
        mine = sorted({slot_key(x): x for x in loras if x is not None}.items())
        gathered: list[list[tuple[Key, LoRARequest]] | None] = \
            [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        union: dict[Key, LoRARequest] = {}
        for replica in gathered:
            for key, lora in replica or []:
                union.setdefault(key, lora)
        self._steps += 1
        self.active = bool(union)
        if len(union) > len(self.in_slot):
            raise RuntimeError(f"DP+EP: the replicas' steps need {len(union)} expert adapter "
                               f"slots; there are {len(self.in_slot)} (data_parallel_size x "
                               "max_loras)")
        for key in union:
            if key in self.slot_of:
                self.last_used[self.slot_of[key]] = self._steps
        writes = []
        for key in sorted(union):
            if key not in self.slot_of:
                writes.append((self._take(key, set(union)), union[key]))
        return writes

    def _take(self, key: Key, needed: set[Key]) -> int:
        free = [s for s, held in enumerate(self.in_slot) if held is None]
        slot = free[0] if free else min(
            (s for s, held in enumerate(self.in_slot) if held not in needed),
            key=lambda s: self.last_used[s])
        old = self.in_slot[slot]
        if old is not None:
            del self.slot_of[old]
        self.in_slot[slot], self.slot_of[key] = key, slot
        self.last_used[slot] = self._steps
        return slot

    def confirm(self, writes: list[tuple[int, LoRARequest]], error: str | None) -> None:
        """After the loads of `writes` (every replica calls it when writes is not empty, as
        the table says alike): raises on every replica when one failed, its slots emptied."""
        gathered: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, error, group=self.group)
        failed = [(r, e) for r, e in enumerate(gathered) if e is not None]
        if not failed:
            return
        for slot, lora in writes:
            self.in_slot[slot] = None
            self.slot_of.pop(slot_key(lora), None)
        rank, message = failed[0]
        raise RuntimeError(f"DP+EP: replica {rank} could not load the expert slices of a LoRA "
                           f"adapter another replica's step needs: {message}")

    def set_tokens(self, loras: list[LoRARequest | None], num_tokens: list[int]) -> None:
        """The step's token -> shared slot rows (-1: no adapter), in the step's order."""
        rows: list[int] = []
        for lora, n in zip(loras, num_tokens):
            rows.extend([-1 if lora is None else self.slot_of[slot_key(lora)]] * n)
        n, prev = len(rows), self.num_tokens
        if n > self.token_slots.shape[0]:
            raise ValueError(f"a step of {n} tokens; the LoRA slot table holds "
                             f"{self.token_slots.shape[0]}")
        if n:
            self.token_slots[:n].copy_(torch.tensor(rows, dtype=torch.int32))
        if prev > n:
            self.token_slots[n:prev].fill_(-1)
        self.num_tokens = n

    def dispatched(self, num_tokens: int) -> torch.Tensor | None:
        """The slots that travel with the step's first num_tokens tokens, None in a step
        without adapters on any replica."""
        return self.token_slots[:num_tokens] if self.active else None


# ---- the settings the replicas must share --------------------------------------------------
def lora_settings(config: LoRAConfig | None) -> tuple:
    """What the shared table depends on: whether LoRA is on, max_loras (the table's size is
    data_parallel_size times it), max_lora_rank and target_modules (the slots' shapes and
    whether the experts take adapters at all)."""
    if config is None:
        return (False,)
    return True, config.max_loras, config.max_lora_rank, config.target_modules


def check_same_lora_settings(settings: list[tuple]) -> None:
    """Every replica's lora_settings, by rank; ValueError naming them when they differ."""
    if all(s == settings[0] for s in settings):
        return
    names = ("enable_lora", "max_loras", "max_lora_rank", "lora_target_modules")
    shown = "; ".join(f"replica {r}: " + ", ".join(f"{n}={v!r}" for n, v in zip(names, s))
                      for r, s in enumerate(settings))
    raise ValueError("DP+EP (enable_expert_parallel with data_parallel_size > 1): the "
                     "replicas must share their LoRA settings (enable_lora, max_loras, "
                     "max_lora_rank, lora_target_modules: the MoE experts' adapter slots are "
                     f"numbered alike on all of them); got {shown}")

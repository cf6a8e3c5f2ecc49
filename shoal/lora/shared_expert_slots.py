"""DP+EP: the expert adapter slots numbered alike on every replica.

Why: under DP+EP (shoal/engine/dp_lockstep.py) each replica schedules its own requests and
numbers its dense adapter slots its own way, but the all-to-all (shoal/layers/moe/
all_to_all.py) hands a token's (token, expert) pairs to the replicas owning its experts. The
owner must apply the token's adapter to its own experts, and may never have seen a request of
that adapter. So the expert slots form one table shared by the replicas:

- Before each forward pass (set_step, also a replica's dummy pass) the replicas agree on the
  adapters of their steps' tokens and each runs the same deterministic assignment on the
  union: an adapter keeps its slot, a new one takes a free slot or the least recently used one
  no step token needs. Same inputs, same order: every replica ends with the same table, and
  loads the adapters new to it (its own experts' slices, read from disk where its host memory
  lacks them) before the forward pass.
- Agreeing is cheap while no replica's set changes, the usual case over a run of decode
  steps: each replica bids whether its step's adapters differ from those it sent last time
  (one all-reduce, max, of an int over the lockstep's CPU group: no pickling, no device
  sync). Only when some replica's did do they exchange their sets (an all_gather_object over
  the expert-parallel group); otherwise the union is the one agreed last, and every replica
  marks it used at this step, as the exchange would have. (The bid cannot ride on the
  lockstep's round at the start of a step: that round comes before the scheduler picks the
  step's requests.)
- A token's slot in that table travels beside its hidden state in the all-to-all (only in
  steps where some replica has an adapter: every replica knows from the union), and the
  owner adds the delta of that slot's A and B of its local expert.

An adapter is keyed by (id, folder, digest of its files): two replicas serving two versions of
one id get two slots. Each replica's scheduler admits at most max_loras adapters a step, so the
union never exceeds data_parallel_size * max_loras slots; each replica holds that many slots of
its experts (E / dp of them): the memory of max_loras slots of every expert, as on one rank.
Pins (pin_lora) hold dense slots only; an expert slot is taken when a step needs it.

An adapter some replica cannot load (its files changed or went away, so one version of an id
is gone from disk while another replica still serves it from memory) fails the requests it
must, as on one rank (there the failed load raises and the step's requests fail:
engine/suspects.py; here with ENGINE_FAILED and the reason, engine/scheduler_results.py),
and the others' requests go on. Which requests depends on what the table holds:
- A replica's own failed (dense) load travels in the exchange. When the adapter already has a
  shared slot, no write is needed and every replica's expert slices of it are valid: it stays
  in the table and only that replica's requests of it fail (they run this step without it).
- When it has none, it would need a new slot, whose expert slices that replica cannot read:
  the replicas leave it out of the table and its requests fail on every replica, as they do
  for a failed write of a new slot (confirm's exchange).
A later step that names it again (another request of that version) bids a change, so it is
tried again, never left half-agreed. Every replica runs the same collectives either way: what
a replica's own refusal changes is only which of its tokens go without the adapter.

The replicas must agree on the settings the table depends on: check_same_lora_settings runs
when they join (dp_lockstep.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shoal.config.lora import LoRAConfig
from shoal.lora_request import LoRARequest

Key = tuple[int, str, str]  # (lora_int_id, lora_path, content_digest or "")
AgreeMax = Callable[[int], int]  # a replica's bid -> the largest of any replica's


def slot_key(lora: LoRARequest) -> Key:
    return lora.lora_int_id, lora.lora_path, lora.content_digest or ""


@dataclass
class Agreement:
    """What one step's agreement asks of every replica (the same on each)."""

    # (slot, adapter) assigned anew: each replica loads its experts' slices of them now
    writes: list[tuple[int, LoRARequest]] = field(default_factory=list)
    # adapters whose requests fail here: key -> why. Those left out of the table (alike on
    # every replica), and this replica's own refusals of adapters kept in it
    failed: dict[Key, str] = field(default_factory=dict)


class SharedExpertSlots:
    """One replica's copy of the table, and its steps' token -> shared slot rows."""

    def __init__(self, num_slots: int, max_tokens: int, group: Any, device: torch.device):
        self.group = group  # the expert-parallel group of the replicas (FusedMoE's dispatch)
        # the lockstep's all-reduce (engine/dp_lockstep.py: DPLockstep.agree_max), set once
        # the engine core has it; None: the sets are exchanged at every step
        self.agree_max: AgreeMax | None = None
        self.in_slot: list[Key | None] = [None] * num_slots
        self.slot_of: dict[Key, int] = {}
        self.last_used = [0] * num_slots
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.num_tokens = 0
        self.active = False  # some replica's step has an adapter: slots travel with tokens
        self._steps = 0
        self._sent: list[Key] = []  # this replica's step adapters at the last exchange
        self._union: list[Key] = []  # every replica's then, those that failed left out
        self._refused_here: set[Key] = set()  # kept in the table; this replica's tokens skip it

    def agree(self, loras: list[LoRARequest | None], refused: dict[Key, str]) -> Agreement:
        """A collective: the step's adapters of every replica into the table. `refused`: the
        adapters this replica could not load itself (key -> why). Every replica gets the same
        writes (and the same failed, but for its own refusals of adapters the table keeps):
        it loads the writes into its layers' slots before the forward pass, then calls
        confirm."""
        mine = sorted({slot_key(x): x for x in loras if x is not None}.items())
        keys = [key for key, _ in mine]
        self._steps += 1
        self._refused_here = set()
        changed = (keys != self._sent or bool(refused)
                   or any(key not in self.slot_of for key in keys))
        if self.agree_max is not None and not self.agree_max(int(changed)):
            for key in self._union:  # what the exchange would have marked used
                self.last_used[self.slot_of[key]] = self._steps
            return Agreement()
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (mine, refused), group=self.group)
        self._sent = keys
        me = dist.get_rank(self.group)
        union: dict[Key, LoRARequest] = {}
        failed: dict[Key, str] = {}
        own: dict[Key, str] = {}  # refused here, kept in the table (a valid slot, no write)
        for rank, (replica, errors) in enumerate(gathered):
            for key, why in errors.items():
                why = f"DP+EP replica {rank} could not load {why}"
                if key not in self.slot_of:  # (the table is alike on every replica)
                    failed.setdefault(key, why)
                elif rank == me:
                    own[key] = why
            for key, lora in replica:
                union.setdefault(key, lora)
        for key in failed:
            union.pop(key, None)
            self._forget(key)
        self._refused_here = set(own)
        self._union = sorted(union)
        self.active = bool(union)
        if len(union) > len(self.in_slot):
            raise RuntimeError(f"DP+EP: the replicas' steps need {len(union)} expert adapter "
                               f"slots; there are {len(self.in_slot)} (data_parallel_size x "
                               "max_loras)")
        for key in union:
            if key in self.slot_of:
                self.last_used[self.slot_of[key]] = self._steps
        writes = []
        for key in self._union:
            if key not in self.slot_of:
                writes.append((self._take(key, set(union)), union[key]))
        return Agreement(writes, {**failed, **own})

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

    def _forget(self, key: Key) -> None:
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.in_slot[slot] = None

    def confirm(self, writes: list[tuple[int, LoRARequest]], errors: dict[Key, str]
                ) -> dict[Key, str]:
        """After the loads of `writes` (every replica calls it when writes is not empty, as
        the table says alike), `errors` this replica's failed ones (key -> why). Returns
        every replica's, the same on each: those adapters' slots are emptied."""
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, errors, group=self.group)
        failed: dict[Key, str] = {}
        for rank, replica in enumerate(gathered):
            for key, why in replica.items():
                failed.setdefault(key, f"DP+EP replica {rank} could not load the expert "
                                       f"slices of {why}")
        for key in failed:
            self._forget(key)
        self._union = [key for key in self._union if key not in failed]
        self.active = bool(self._union)
        return failed

    def set_tokens(self, loras: list[LoRARequest | None], num_tokens: list[int]) -> None:
        """The step's token -> shared slot rows (-1: no adapter, or one that failed, or one
        this replica refused), in the step's order."""
        rows: list[int] = []
        for lora, n in zip(loras, num_tokens):
            key = None if lora is None else slot_key(lora)
            slot = (-1 if key is None or key in self._refused_here
                    else self.slot_of.get(key, -1))
            rows.extend([slot] * n)
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

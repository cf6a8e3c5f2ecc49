"""The worker's adapters: up to max_cpu_loras loaded in host memory (least recently used
dropped first, read again from disk when asked for) and max_loras in the layers' device
slots (least recently used slot reused). Each step writes its tokens' slots into the shared
table (LoRAStep); the scheduler never runs a step with more distinct adapters than slots.
Under pipeline parallelism each stage holds the slots of its own layers and reads only the
adapter tensors of those (stage_limits.py). Which modules get slots at all: the
lora_target_modules setting (target_modules.py; by default the MoE experts too). Under DP+EP
the MoE experts' slots are a table the replicas share (shared_expert_slots.py), agreed at
each step; the dense slots stay this replica's own. There a step's adapter that cannot be
loaded (its files changed or went away) fails its requests alone, with the reason, on every
replica or only on the one that could not load it (shared_expert_slots.py; set_step's
step_errors, per request): raising would leave the other replicas waiting in the step's
collectives. On one rank, or one group of tensor-parallel ranks, a failed load raises and the
engine core fails the step's requests (engine/suspects.py).

An adapter held (in host memory or a slot) is one version of its folder: (path, digest of
its files). A request whose content_digest names another version reads the folder again, and
that read must find the version it names (the engine core keyed its KV blocks by it).

Pinned adapters (vLLM's pin_lora) are never dropped from host memory nor from their slot.
Fewer than max_loras may be pinned: one slot at least stays for the other adapters, whose
requests would otherwise wait for ever (the scheduler admits unpinned adapters into the
slots left unpinned, engine/admission.py)."""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from shoal.config.lora import ALL_LINEAR, EXPERTS, TARGET_MODULES_SETTING, LoRAConfig
from shoal.lora.adapter import LoRALimits, check_adapter
from shoal.lora.adapter_digest import changed_message
from shoal.lora.expert_layers import (
    ExpertLoRA,
    add_expert_lora,
    dispatch_group,
    expert_targets,
    moe_layers,
)
from shoal.lora.layers import LoRALayer, LoRAStep, add_lora_layers, fused_parts, lora_targets
from shoal.lora.shared_expert_slots import Key, SharedExpertSlots, slot_key
from shoal.lora.stage_limits import StageModules, whole_model_limits
from shoal.lora.target_modules import expand, unknown_names, wants_experts
from shoal.lora.weights import AdapterWeights, load_adapter_weights
from shoal.lora_request import LoRARequest

logger = logging.getLogger(__name__)

Version = tuple[str, str]  # (folder, digest of its files)


def _matches(held: Version | None, lora: LoRARequest) -> bool:
    """Whether the held version serves the request (one without a digest takes whatever
    version of its folder is held: pin_lora's and direct callers')."""
    return held is not None and held[0] == lora.lora_path and (
        lora.content_digest is None or held[1] == lora.content_digest)


class LoRASlots:
    def __init__(self, model: nn.Module, config: LoRAConfig, max_tokens: int,
                 dtype: torch.dtype, device: torch.device):
        self.config, self.dtype, self.device = config, dtype, device
        self.step = LoRAStep(max_tokens, device, use_triton=device.type == "cuda")
        fused = fused_parts(model)
        targets = expand(config.target_modules, fused)  # (target_modules.py)
        dense = add_lora_layers(model, self.step, config.max_loras, config.max_lora_rank,
                                dtype, device, targets)
        self.layers: list[LoRALayer] = dense.layers
        # the routed experts of MoE layers (expert_layers.py), when asked for; under DP+EP
        # in slots the replicas share (a step's adapters of every replica: dp x max_loras)
        group = dispatch_group(model)
        self.dp_ep = group is not None  # replicas in lockstep: a failed load must not raise
        num_slots = config.max_loras * (1 if group is None else dist.get_world_size(group))
        self.expert_layers: list[ExpertLoRA] = add_expert_lora(
            model, self.step, num_slots, config.max_lora_rank, dtype, device
        ) if wants_experts(targets) else []
        self.shared: SharedExpertSlots | None = None
        if group is not None and self.expert_layers:
            self.shared = SharedExpertSlots(num_slots, max_tokens, group, device)
            for layer in self.expert_layers:
                layer.shared = self.shared
        if self.expert_layers:
            nbytes = sum(layer.nbytes for layer in self.expert_layers)
            logger.info("LoRA: adapter slots for the MoE experts of %d layers take %.2f GiB "
                        "(--lora-target-modules %s leaves the experts out)",
                        len(self.expert_layers), nbytes / 2**30, ALL_LINEAR)
        left_out = set(dense.left_out)
        if moe_layers(model) and not self.expert_layers:
            left_out.add(EXPERTS)
        stage = LoRALimits(config.max_loras, config.max_lora_rank, lora_targets(self.layers),
                           expert_targets(self.expert_layers), tuple(sorted(left_out)))
        self.stage_modules = StageModules.of(stage)
        # adapters are checked against every stage's projections (this one's alone on one)
        self.limits = whole_model_limits(stage)
        known = {n.rsplit(".", 1)[-1] for n in self.limits.targets} | set(fused) \
            | set(self.limits.left_out) | ({EXPERTS} if self.limits.experts else set())
        if unknown := unknown_names(targets, known):
            raise ValueError(f"{TARGET_MODULES_SETTING}: {', '.join(map(repr, unknown))} "
                             f"name(s) no module of {type(model).__name__} that takes LoRA "
                             f"(it has: {', '.join(sorted(known))})")
        if not self.limits.targets and not self.limits.experts:
            raise ValueError(f"{type(model).__name__} has no projections LoRA can adapt")
        self.host: OrderedDict[int, tuple[Version, AdapterWeights]] = OrderedDict()
        self.slot_of: dict[int, int] = {}  # adapter id -> device slot
        self.in_slot: list[int | None] = [None] * config.max_loras  # slot -> adapter id
        self.slot_version: list[Version | None] = [None] * config.max_loras
        self.last_used = [0] * config.max_loras
        self.pinned: set[int] = set()  # adapter ids kept in host memory and in their slot
        self._steps = 0
        self.loads = 0  # adapters read from disk (tests and logs)
        self.step_errors: list[str | None] = []  # (set_step's: its requests' failed loads)

    # ---- host memory --------------------------------------------------------------------------
    def add(self, lora: LoRARequest) -> AdapterWeights:
        """The adapter's weights in host memory (read now unless loaded); ValueError when
        the adapter does not fit this model."""
        held = self.host.get(lora.lora_int_id)
        if held is not None and _matches(held[0], lora):
            self.host.move_to_end(lora.lora_int_id)
            return held[1]
        version, weights = self._read(lora)
        stale = self.slot_of.get(lora.lora_int_id)
        if stale is not None and self.slot_version[stale] != version:
            # the same id, another folder or version: its slot holds stale weights (a pin
            # stays: the id is pinned, whatever folder it names)
            self.in_slot[stale] = self.slot_version[stale] = None
            del self.slot_of[lora.lora_int_id]
        self.host[lora.lora_int_id] = (version, weights)
        self.host.move_to_end(lora.lora_int_id)
        self._drop_from_host(keep=lora.lora_int_id)
        return weights

    def _read(self, lora: LoRARequest) -> tuple[Version, AdapterWeights]:
        """The adapter's folder read from disk, checked against this model and the version
        the request names."""
        spec = check_adapter(lora.lora_path, self.limits)
        if lora.content_digest is not None and spec.digest != lora.content_digest:
            raise ValueError(changed_message(lora.lora_path))
        weights = load_adapter_weights(self.stage_modules.part_of(spec), self.dtype,
                                       pin=self.device.type == "cuda")
        self.loads += 1
        return (lora.lora_path, spec.digest), weights

    def _drop_from_host(self, keep: int) -> None:
        """Least recently used first, never a pinned adapter nor `keep` (the one just
        read): fewer than max_loras <= max_cpu_loras are pinned, so one is always found."""
        while len(self.host) > self.config.cpu_capacity:
            old = next(i for i in self.host if i not in self.pinned and i != keep)
            del self.host[old]
            logger.debug("LoRA adapter %d dropped from host memory", old)

    def remove(self, lora_id: int) -> bool:
        """Forgets the adapter (host copy, slot and pin); a later request reads it again.
        False when it was not loaded."""
        self.pinned.discard(lora_id)
        held = self.host.pop(lora_id, None) is not None
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.in_slot[slot] = self.slot_version[slot] = None
        return held or slot is not None

    def loaded(self) -> set[int]:
        """The ids of the adapters held in host memory or in a device slot (a request of
        one of them reads nothing from disk)."""
        return set(self.host) | set(self.slot_of)

    def preload(self, lora: LoRARequest) -> None:
        """add_lora: the adapter into host memory, and into a device slot if one is free
        (a slot that holds another adapter is left alone: running requests may use it)."""
        weights = self.add(lora)
        if lora.lora_int_id not in self.slot_of and None in self.in_slot:
            self._write(self.in_slot.index(None), lora.lora_int_id,
                        self.host[lora.lora_int_id][0], weights)

    def pin(self, lora_id: int) -> None:
        """Keeps a loaded adapter in host memory and in a device slot (taken now: a free
        one, else the least recently used unpinned one) until it is removed."""
        if lora_id in self.pinned:
            return
        if lora_id in self.host:
            version = self.host[lora_id][0]
        elif lora_id in self.slot_of:
            version = self.slot_version[self.slot_of[lora_id]]
        else:
            raise ValueError(f"LoRA adapter {lora_id} is not loaded: add_lora or a request "
                             "naming it loads it before it can be pinned")
        limit = len(self.in_slot)
        if len(self.pinned) + 1 >= limit:
            raise ValueError(f"cannot pin LoRA adapter {lora_id}: {len(self.pinned)} of the "
                             f"max_loras={limit} device slots are pinned, and one must stay "
                             "for the other adapters' requests (raise max_loras)")
        assert version is not None
        # (read again only if host memory had dropped it while its slot kept it)
        weights = self.add(LoRARequest(f"lora-{lora_id}", lora_id, version[0],
                                       content_digest=version[1]))
        if lora_id not in self.slot_of:
            free = [s for s, held_id in enumerate(self.in_slot) if held_id is None]
            slot = free[0] if free else self._least_recent(keep=set())
            self._write(slot, lora_id, version, weights)
        self.pinned.add(lora_id)

    # ---- device slots -------------------------------------------------------------------------
    def set_step(self, loras: list[LoRARequest | None], num_tokens: list[int]) -> None:
        """The step's requests' adapters and token counts, in the step's order. Sets
        step_errors: empty, or per request None or why its adapter could not be had; only
        under DP+EP, where such a request runs this step without the adapter and the runner
        fails it (elsewhere a failed load raises)."""
        self._steps += 1
        self.step_errors = []
        wanted = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if len(wanted) > len(self.in_slot):
            raise RuntimeError(f"a step with {len(wanted)} LoRA adapters; max_loras is "
                               f"{len(self.in_slot)}")
        refused: dict[Key, str] = {}  # (DP+EP) this replica's adapters it could not load
        for lora in wanted.values():
            if not self.dp_ep:
                self._slot(lora, set(wanted))
                continue
            try:
                self._slot(lora, set(wanted))
            except Exception as e:  # (the other replicas hear of it in _share_expert_slots)
                refused[slot_key(lora)] = _why(lora, e)
        table: list[int] = []
        for lora, n in zip(loras, num_tokens):
            slot = (-1 if lora is None or (refused and slot_key(lora) in refused)
                    else self.slot_of[lora.lora_int_id])
            table.extend([slot] * n)
        self.step.set(table)
        failed = (refused if self.shared is None
                  else self._share_expert_slots(loras, num_tokens, refused))
        if failed:
            self.step_errors = [None if lora is None else failed.get(slot_key(lora))
                                for lora in loras]

    def _share_expert_slots(self, loras: list[LoRARequest | None], num_tokens: list[int],
                            refused: dict[Key, str]) -> dict[Key, str]:
        """DP+EP (a collective, every replica at every forward pass): the replicas' step
        adapters into the shared expert slots, new ones loaded (shared_expert_slots.py).
        Returns the adapters some replica could not load (key -> why), the same on every
        replica: their tokens run without them."""
        assert self.shared is not None
        agreed = self.shared.agree(loras, refused)
        failed = dict(agreed.failed)
        if agreed.writes:  # (alike on every replica, so is confirm's collective)
            errors: dict[Key, str] = {}
            for slot, lora in agreed.writes:
                try:
                    weights = self._expert_weights(lora)
                    for layer in self.expert_layers:
                        layer.write_slot(slot, weights)
                except Exception as e:  # every replica hears of it (confirm), none waits
                    errors[slot_key(lora)] = _why(lora, e)
            failed.update(self.shared.confirm(agreed.writes, errors))
        self.shared.set_tokens(loras, num_tokens)
        return failed

    def _expert_weights(self, lora: LoRARequest) -> AdapterWeights:
        """The weights of an adapter some replica's step needs: add()'s (from host memory,
        else read and kept), unless this replica holds another version of its id for its own
        requests: then read aside, its dense slot and host copy left alone."""
        held = self.host.get(lora.lora_int_id)
        slot = self.slot_of.get(lora.lora_int_id)
        if (held is not None and not _matches(held[0], lora)) or (
                slot is not None and not _matches(self.slot_version[slot], lora)):
            return self._read(lora)[1]
        return self.add(lora)

    def _slot(self, lora: LoRARequest, keep: set[int]) -> int:
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is not None and _matches(self.slot_version[slot], lora):
            self.last_used[slot] = self._steps
            return slot
        weights = self.add(lora)
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is None:
            free = [s for s, held_id in enumerate(self.in_slot) if held_id is None]
            slot = free[0] if free else self._least_recent(keep)
        self._write(slot, lora.lora_int_id, self.host[lora.lora_int_id][0], weights)
        return slot

    def _least_recent(self, keep: set[int]) -> int:
        """The least recently used slot whose adapter is neither pinned nor in `keep`."""
        candidates = [s for s, held_id in enumerate(self.in_slot)
                      if held_id not in keep and held_id not in self.pinned]
        if not candidates:  # the scheduler's admission rule makes this unreachable
            raise RuntimeError(f"no LoRA slot to reuse: {len(self.pinned)} pinned, the step "
                               f"needs {sorted(keep)}; max_loras is {len(self.in_slot)}")
        return min(candidates, key=lambda s: self.last_used[s])

    def _write(self, slot: int, lora_id: int, version: Version, weights: AdapterWeights
               ) -> None:
        old = self.in_slot[slot]
        if old is not None and old != lora_id:
            del self.slot_of[old]
        # (the experts' slots are this replica's own but under DP+EP: set_step fills those)
        own_experts = self.expert_layers if self.shared is None else []
        for layer in (*self.layers, *own_experts):
            layer.write_slot(slot, weights)
        self.in_slot[slot] = lora_id
        self.slot_version[slot] = version
        self.slot_of[lora_id] = slot
        self.last_used[slot] = self._steps


def _why(lora: LoRARequest, error: Exception) -> str:
    """An adapter's failed load, as its requests' error reads (with the replica before it)."""
    return (f"LoRA adapter {lora.lora_name!r} (id {lora.lora_int_id}): "
            f"{type(error).__name__}: {error}")

"""What the tensor-parallel driver (rank 0) tells its worker ranks, as msgpack (no pickle on
the IPC path). Every rank runs each command in the same order: the collectives inside the
model keep them in lockstep."""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.core.scheduler_output import SchedulerOutput
from shoal.lora_request import LoRARequest


class InitKVCache(msgspec.Struct, tag="init_kv"):
    pass


class RunStep(msgspec.Struct, tag="step"):
    sched: SchedulerOutput


class FinishStep(msgspec.Struct, tag="finish"):
    """Pipeline parallelism: the driver finishes its oldest step in flight. Every rank
    finishes its own then (stage 0's other TP ranks gather logits and sample in it), so the
    collectives of launches and finishes interleave alike on every rank."""


class RemoveRequests(msgspec.Struct, tag="remove"):
    serials: list[int]


class RemoveLoRA(msgspec.Struct, tag="remove_lora"):
    lora_id: int


class AddLoRA(msgspec.Struct, tag="add_lora"):
    """add_lora: the driver read the adapter first (a bad one never reaches the ranks)."""

    lora: LoRARequest


class PinLoRA(msgspec.Struct, tag="pin_lora"):
    lora_id: int


class CollectiveRPC(msgspec.Struct, tag="rpc"):
    """A lifecycle method on every rank; the results are gathered over the ranks' group."""

    method: str
    args: list[Any]


class ResetAfterFault(msgspec.Struct, tag="reset"):
    pass


class CheckHealth(msgspec.Struct, tag="check_health"):
    """A step of one made-up token on every rank (the model's collectives need them all)."""


class Stop(msgspec.Struct, tag="stop"):
    pass


Command = (InitKVCache | RunStep | FinishStep | RemoveRequests | RemoveLoRA | AddLoRA | PinLoRA
           | CollectiveRPC | ResetAfterFault | CheckHealth | Stop)

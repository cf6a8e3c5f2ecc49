"""A rank's LoRA adapters (mixed into ModelRunner): the step's adapters read ahead of it and
set into their slots, and the engine core's add_lora, remove_lora, pin_lora and list_loras.
Every rank runs the same calls in the same order (the driver's commands,
shoal/executor/commands.py), so all ranks hold the same adapters. Under DP+EP the step's
adapters are read as they are set (a replica whose load fails fails those requests alone:
lora/slots.py), and the lockstep's all-reduce reaches the shared expert slots
(lockstep_loras)."""

from __future__ import annotations

from typing import Any

from shoal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shoal.lora.shared_expert_slots import AgreeMax
from shoal.lora.slots import LoRASlots
from shoal.lora_request import LoRARequest


class RunnerLoRA:
    # (set by ModelRunner)
    lora: LoRASlots | None
    requests: dict[int, Any]  # serial -> RequestState

    def load_step_loras(self, sched: SchedulerOutput) -> None:
        """LoRA: the step's adapters into host memory (read from disk where not there yet);
        raises when one cannot be read. (DP+EP: set_lora_step reads them.)"""
        if self.lora is None or self.lora.dp_ep:
            return
        new = {n.serial: n.lora for n in sched.new_requests}
        for it in sched.scheduled:
            lora = new[it.serial] if it.serial in new else self.requests[it.serial].lora
            if lora is not None:
                self.lora.add(lora)

    def set_lora_step(self, inp: Any, out: ModelRunnerOutput) -> None:
        """The step's adapters into their slots (inp: the step's StepInputs). Under DP+EP a
        request whose adapter some replica could not load runs without it and ends with
        why (out.failed_errors)."""
        assert self.lora is not None
        self.lora.set_step([st.lora for st in inp.states], inp.query_lens())
        for item, error in zip(inp.items, self.lora.step_errors):
            if error is not None:
                out.failed_errors[item.serial] = error

    def lockstep_loras(self, agree: AgreeMax) -> None:
        """DP+EP: `agree`, the replicas' all-reduce (max) of engine/dp_lockstep.py, lets the
        shared expert slots skip exchanging a step's adapters no replica changed."""
        if self.lora is not None and self.lora.shared is not None:
            self.lora.shared.agree_max = agree

    def add_lora(self, lora: LoRARequest) -> bool:
        """Reads the adapter into host memory (and a free device slot) ahead of requests;
        a ValueError naming it when it cannot be served."""
        try:
            self._lora_slots().preload(lora)
        except ValueError as e:
            raise ValueError(f"add_lora {lora.lora_name!r} (id {lora.lora_int_id}): {e}"
                             ) from None
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """False when the adapter was not loaded."""
        return self.lora is not None and self.lora.remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        self._lora_slots().pin(lora_id)
        return True

    def list_loras(self) -> set[int]:
        return self.lora.loaded() if self.lora is not None else set()

    def _lora_slots(self) -> LoRASlots:
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with "
                             "enable_lora=True)")
        return self.lora

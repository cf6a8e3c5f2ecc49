"""A rank's LoRA adapters outside its steps' own loads (mixed into ModelRunner): the step's
adapters read ahead of it, and the engine core's add_lora, remove_lora, pin_lora and
list_loras. Every rank runs the same calls in the same order (the driver's commands,
shoal/executor/commands.py), so all ranks hold the same adapters."""

from __future__ import annotations

from typing import Any

from shoal.core.scheduler_output import SchedulerOutput
from shoal.lora.slots import LoRASlots
from shoal.lora_request import LoRARequest


class RunnerLoRA:
    # (set by ModelRunner)
    lora: LoRASlots | None
    requests: dict[int, Any]  # serial -> RequestState

    def load_step_loras(self, sched: SchedulerOutput) -> None:
        """LoRA: the step's adapters into host memory (read from disk where not there yet);
        raises when one cannot be read."""
        if self.lora is None:
            return
        new = {n.serial: n.lora for n in sched.new_requests}
        for it in sched.scheduled:
            lora = new[it.serial] if it.serial in new else self.requests[it.serial].lora
            if lora is not None:
                self.lora.add(lora)

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

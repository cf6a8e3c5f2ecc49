"""The LoRA engine arguments (vLLM's --enable-lora family), kept beside EngineArgs, which
inherits them, and their LoRAConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.config.lora import LoRAConfig


def _arg(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class LoRAArgs:
    enable_lora: bool = _arg(False, "serve LoRA adapters (PEFT folders) over the base model: "
                                    "a request names one (lora_request offline, its model "
                                    "name when serving)")
    max_loras: int = _arg(1, "LoRA: distinct adapters in one step (device slots)")
    max_lora_rank: int = _arg(16, "LoRA: the largest adapter rank (1, 8, 16, 32, 64, 128, "
                                  "256, 320 or 512)")
    max_cpu_loras: int | None = _arg(None, "LoRA: adapters kept loaded in host memory "
                                           "(default: max_loras)")
    lora_target_modules: list[str] | None = field(default=None, metadata={"nargs": "+", "help": (
        "LoRA: the module names that get adapter slots, e.g. q_proj v_proj; all-linear for "
        "every projection, experts for the MoE experts (default: every projection and the "
        "experts, as vLLM)")})

    def lora_settings(self) -> LoRAConfig:
        """The LoRA settings whether or not enable_lora is on; ValueError naming a bad one."""
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool (got {self.enable_lora!r})")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras,
                          self.lora_target_modules)

"""LoRA serving settings (vLLM's --enable-lora family): how many adapters a step may mix
(device slots), the largest rank, how many adapters stay loaded in host memory, and which
modules get adapter slots (shoal/lora/target_modules.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Models whose adaptable projections all run on every token of a step, in order (the step's
# token -> slot table lines up with their rows): shoal.lora.layers adapts them.
LORA_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
    # issue 33's native families (their checkpoint names: shoal/lora/layers.py)
    "CohereForCausalLM", "Gemma2ForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM",
    "GraniteForCausalLM", "GraniteMoeForCausalLM", "MixtralForCausalLM", "Olmo2ForCausalLM",
    "Phi3ForCausalLM", "SmolLM3ForCausalLM", "Starcoder2ForCausalLM"})

# vLLM's allowed --max-lora-rank values
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# target_modules' own names (shoal/lora/target_modules.py): every projection (PEFT's name),
# the routed experts of the MoE layers
ALL_LINEAR = "all-linear"
EXPERTS = "experts"
TARGET_MODULES_SETTING = "lora_target_modules"


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # distinct adapters in one step (each a device slot)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded on the host (default: max_loras)
    # vLLM's target_modules: the module leaf names that get slots (None: every projection
    # and the MoE experts; a list has `experts` for them, `all-linear` for every projection)
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))} "
                             f"(got {self.max_lora_rank})")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool)
                                or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras "
                             f"({self.max_loras}) (got {cpu!r})")
        object.__setattr__(self, "target_modules", check_target_modules(self.target_modules))

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def check_target_modules(value: Any) -> tuple[str, ...] | None:
    """target_modules as a tuple (None stays None); ValueError naming what is wrong. Whether
    each name is one of the model's is checked when the worker builds its slots."""
    name = TARGET_MODULES_SETTING
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of module names (got {value!r})")
    names = tuple(value)
    if not names:
        raise ValueError(f"{name} must name at least one module (leave it unset for every "
                         "projection)")
    for entry in names:
        if not isinstance(entry, str) or not entry or "." in entry:
            raise ValueError(f"{name} entries must be module leaf names such as q_proj, "
                             f"{ALL_LINEAR} or {EXPERTS} (got {entry!r})")
    return names

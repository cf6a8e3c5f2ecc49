"""Model classes by the `architectures` name in a Hugging Face config, imported lazily.

Adding an architecture: a class that follows shoal/models/interface.py, one line here (and
one in _BY_MODEL_TYPE), and its entry in tests/models/test_interface.py."""

from __future__ import annotations

import importlib
from typing import Any

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("shoal.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("shoal.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("shoal.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("shoal.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("shoal.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}

# model_type -> architecture, for configs that do not list `architectures`.
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(hf_config: Any) -> type:
    archs = list(getattr(hf_config, "architectures", None) or [])
    mt = getattr(hf_config, "model_type", None)
    if not archs and mt in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[mt]]
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"unsupported model architecture {archs or mt!r}; supported: {', '.join(supported_architectures())}"
    )

"""The prompt side of each vision-language family: how many placeholder tokens an image
becomes and what tensors its encoder reads (base.py says the contract; the table below says
which module serves which architecture, imported lazily)."""

from __future__ import annotations

import importlib
from typing import Any

# HF architecture -> (module, class) of its processor
_PROCESSORS: dict[str, tuple[str, str]] = {
    "Qwen2_5_VLForConditionalGeneration": ("shoal.multimodal.processors.qwen_vl",
                                           "QwenVLProcessor"),
    "Idefics3ForConditionalGeneration": ("shoal.multimodal.processors.idefics3",
                                         "Idefics3Processor"),
    "Qwen3VLForConditionalGeneration": ("shoal.multimodal.processors.qwen3_vl",
                                        "Qwen3VLProcessor"),
    # Qwen3.5's native vision variants: the same processor (transformers' Qwen3VLProcessor)
    "Qwen3_5ForConditionalGeneration": ("shoal.multimodal.processors.qwen3_vl",
                                        "Qwen3VLProcessor"),
    "Qwen3_5MoeForConditionalGeneration": ("shoal.multimodal.processors.qwen3_vl",
                                           "Qwen3VLProcessor"),
    "LlavaForConditionalGeneration": ("shoal.multimodal.processors.llava", "LlavaProcessor"),
    "Gemma3ForConditionalGeneration": ("shoal.multimodal.processors.gemma3",
                                       "Gemma3Processor"),
}


def processor_class(architecture: str) -> type | None:
    entry = _PROCESSORS.get(architecture)
    if entry is None:
        return None
    return getattr(importlib.import_module(entry[0]), entry[1])


def is_multimodal(hf_config: Any) -> bool:
    return any(a in _PROCESSORS for a in getattr(hf_config, "architectures", None) or [])

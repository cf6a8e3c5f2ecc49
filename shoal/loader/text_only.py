"""Multimodal checkpoints whose text model can run on its own: Qwen3.5's
Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration (the Qwen/Qwen3.5-*
repos). With a vision_config they serve images and video (shoal/models/qwen3_5_vl.py, the
config flattened by multimodal_config.py); language-model-only (vLLM's
--limit-mm-per-prompt '{"image": 0, "video": 0}', or a config.json without a
vision_config) loads them as their text_config's causal LM instead: the language model's
tensors (model.language_model.*) read as model.*, and the vision tower's skipped."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.loader.multimodal_config import multimodal_text_config

logger = logging.getLogger(__name__)

# multimodal architecture -> the causal LM class of its text_config
TEXT_MODELS = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
_LANGUAGE = "model.language_model."
_VISION = ("model.visual.", "visual.")

Rename = Callable[[str], "str | None"]


def declares_vision(folder: Path) -> bool:
    """Whether the folder's config.json has a vision_config (transformers builds a default
    one for a config without it, so the loaded config cannot tell)."""
    path = Path(folder) / "config.json"
    return path.is_file() and "vision_config" in json.loads(path.read_text())


def text_only(config: Any, language_model_only: bool = False) -> tuple[Any, Rename | None]:
    """(the config to run, the checkpoint-name mapping: None keeps every name).
    language_model_only: a checkpoint of TEXT_MODELS runs its text model alone."""
    arch = next((a for a in getattr(config, "architectures", None) or [] if a in TEXT_MODELS),
                None)
    if arch is None or not language_model_only:
        flattened = multimodal_text_config(config)
        if flattened is not None:  # served with its images (shoal/multimodal)
            return flattened, None
        if arch is None:
            return config, None
    text = config.text_config
    text.architectures = [TEXT_MODELS[arch]]
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is not None:  # the checkpoint's head follows the outer config
        text.tie_word_embeddings = tied
    logger.info("%s: serving its text model (%s); the vision tower is not loaded", arch,
                TEXT_MODELS[arch])
    return text, language_model_name


def language_model_name(name: str) -> str | None:
    """model.language_model.X -> model.X; the vision tower's tensors -> None (skipped)."""
    if name.startswith(_LANGUAGE):
        return "model." + name[len(_LANGUAGE):]
    if name.startswith(_VISION):
        return None
    return name

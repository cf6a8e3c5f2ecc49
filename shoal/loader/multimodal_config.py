"""The engine's view of a vision-language checkpoint's config: its text_config (the decoder
the KV cache, scheduler and sampler size themselves by), carrying the outer architecture
name and the whole config (`multimodal_config`) for the model class, which builds the
vision tower from it. Tensor names stay the checkpoint's (the model class maps them)."""

from __future__ import annotations

import copy
from typing import Any

from shoal.multimodal.processors import is_multimodal


def multimodal_text_config(config: Any) -> Any | None:
    """The flattened config of a vision-language checkpoint shoal serves with its images;
    None for any other config."""
    if not is_multimodal(config):
        return None
    text = copy.deepcopy(config.text_config)
    text.architectures = list(config.architectures)
    text.multimodal_config = config
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is not None:
        text.tie_word_embeddings = tied
    for name in ("image_token_id", "video_token_id", "vision_start_token_id",
                 "vision_end_token_id"):
        if getattr(config, name, None) is not None:
            setattr(text, name, getattr(config, name))
    return text

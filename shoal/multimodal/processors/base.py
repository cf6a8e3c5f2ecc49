"""The contract of a vision-language family's processor (frontend side, no model weights).

A processor is built from the checkpoint folder (`cls(folder, hf_config, tokenizer)`): the
image processor is transformers' own for the model (AutoImageProcessor from the folder), so
resizing and normalisation are the checkpoint's. `process` expands each image's placeholder
token in the prompt into the tokens its encoder output fills, and returns one
MultiModalFeature per image, in prompt order."""

from __future__ import annotations

from typing import Any, Protocol

from shoal.multimodal.inputs import MultiModalFeature


class MultiModalProcessor(Protocol):
    # The text one image stands for in a prompt (what a chat image part becomes, and what an
    # offline prompt holds once per image), e.g. "<|vision_start|><|image_pad|><|vision_end|>"
    image_placeholder: str

    def __init__(self, folder: Any, hf_config: Any, tokenizer: Any) -> None: ...

    def process(self, prompt_token_ids: list[int], images: list[Any]
                ) -> tuple[list[int], list[MultiModalFeature]]:
        """The expanded prompt and the images' features. Raises ValueError when the prompt
        does not hold one placeholder per image."""
        ...

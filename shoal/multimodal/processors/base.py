"""The contract of a vision-language family's processor (frontend side, no model weights).

A processor is built from the checkpoint folder (`cls(folder, hf_config, tokenizer)`): the
image processor is transformers' own for the model (AutoImageProcessor from the folder), so
resizing and normalisation are the checkpoint's. `process` expands each image's placeholder
token in the prompt into the tokens its encoder output fills, and returns one
MultiModalFeature per image, in prompt order."""

from __future__ import annotations

from collections.abc import Callable
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


def expand_placeholders(prompt_token_ids: list[int], placeholder_id: int, images: list[Any],
                        placeholder: str,
                        expand: Callable[[Any, int], tuple[list[int], MultiModalFeature]]
                        ) -> tuple[list[int], list[MultiModalFeature]]:
    """Each placeholder_id token of the prompt replaced, in order, by the token ids
    expand(image, offset) gives for its image (offset: where they start in the expanded
    prompt), with the image's feature. Raises ValueError when the prompt does not hold one
    placeholder per image."""
    places = [i for i, t in enumerate(prompt_token_ids) if t == placeholder_id]
    if len(places) != len(images):
        raise ValueError(f"the prompt holds {len(places)} {placeholder} "
                         f"token(s) for {len(images)} image(s)")
    ids: list[int] = []
    features: list[MultiModalFeature] = []
    prev = 0
    for place, image in zip(places, images):
        ids.extend(prompt_token_ids[prev:place])
        layout, feature = expand(image, len(ids))
        features.append(feature)
        ids.extend(layout)
        prev = place + 1
    ids.extend(prompt_token_ids[prev:])
    return ids, features

"""LLaVA prompts: each `<image>` token becomes one `<image>` per image feature, as
transformers' LlavaProcessor expands it: one per patch of the (resized, cropped) image, plus
the CLS token when vision_feature_select_strategy is "full" and the tower has one (CLIP);
"default" drops the first token. The image processor is the checkpoint's
(AutoImageProcessor: CLIPImageProcessor for LLaVA-1.5, its PIL flavour without torchvision)."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.multimodal.inputs import MultiModalFeature, make_feature
from shoal.multimodal.processors.qwen_vl import find_placeholders, load_image_processor


def image_token_id(config: Any) -> int:
    """The `<image>` token: image_token_id, or image_token_index in older configs."""
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ValueError("the LLaVA config names no image_token_id")
    return int(token)


def tokens_per_image(config: Any, height: int, width: int) -> int:
    """Image features of one [3, height, width] image (what the model's tower and
    vision_feature_select_strategy give)."""
    vision = config.vision_config
    patch = int(vision.patch_size)
    n = (height // patch) * (width // patch)
    n += int(getattr(vision, "model_type", "") == "clip_vision_model")  # the CLS token
    if getattr(config, "vision_feature_select_strategy", "default") == "default":
        n -= 1
    return n


class LlavaProcessor:
    image_placeholder = "<image>"
    kind = "llava"

    def __init__(self, folder: Any, hf_config: Any, tokenizer: Any) -> None:
        self.image_processor = load_image_processor(folder)
        # the checkpoint's whole config, also when handed the engine's flattened one
        self.config = getattr(hf_config, "multimodal_config", None) or hf_config
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id(self.config)

    def process(self, prompt_token_ids: list[int], images: list[Any]
                ) -> tuple[list[int], list[MultiModalFeature]]:
        where = find_placeholders(prompt_token_ids, self.image_token_id, len(images),
                                  self.image_placeholder)
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        cursor = 0
        for at, image in zip(where, images):
            ids.extend(prompt_token_ids[cursor:at])
            # one image at a time: its arrays (and content hash) are its own
            out = self.image_processor(images=[image], return_tensors="np")
            pixels = np.asarray(out["pixel_values"], dtype=np.float32)  # [1, 3, H, W]
            n = tokens_per_image(self.config, pixels.shape[2], pixels.shape[3])
            features.append(make_feature(self.kind, "image", len(ids), n,
                                         {"pixel_values": pixels}))
            ids.extend([self.image_token_id] * n)
            cursor = at + 1
        ids.extend(prompt_token_ids[cursor:])
        return ids, features

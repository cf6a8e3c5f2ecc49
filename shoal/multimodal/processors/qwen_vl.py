"""Qwen2.5-VL / Qwen3-VL prompts: each image's single <|image_pad|> token becomes one token
per merged patch group (grid t * h * w / merge^2) of the image processor's output, between
the <|vision_start|> and <|vision_end|> the prompt (or chat part) already holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shoal.multimodal.inputs import MultiModalFeature, make_feature


def load_image_processor(folder: Any) -> Any:
    """transformers' image processor of the checkpoint (its PIL flavour where torchvision is
    missing, which transformers picks itself)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(Path(folder)), local_files_only=True)


def find_placeholders(ids: list[int], token: int, count: int, name: str) -> list[int]:
    """Indices of the prompt's `count` placeholder tokens; ValueError when they differ."""
    where = [i for i, t in enumerate(ids) if t == token]
    if len(where) != count:
        raise ValueError(f"the prompt has {len(where)} {name} placeholders for {count} "
                         f"image(s): put one {name} in the prompt per image")
    return where


class QwenVLProcessor:
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    kind = "qwen_vl"

    def __init__(self, folder: Any, hf_config: Any, tokenizer: Any) -> None:
        self.image_processor = load_image_processor(folder)
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(getattr(self.image_processor, "merge_size", 2))

    def process(self, prompt_token_ids: list[int], images: list[Any]
                ) -> tuple[list[int], list[MultiModalFeature]]:
        where = find_placeholders(prompt_token_ids, self.image_token_id, len(images),
                                  "<|image_pad|>")
        if not images:
            return list(prompt_token_ids), []
        out = self.image_processor(images=images, return_tensors="np")
        pixels, grids = np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        cursor = row = 0
        for i, at in enumerate(where):
            ids.extend(prompt_token_ids[cursor:at])
            grid = grids[i]
            patches = int(grid.prod())
            n = patches // self.merge ** 2
            arrays = {"pixel_values": pixels[row:row + patches], "image_grid_thw": grid}
            features.append(make_feature(self.kind, "image", len(ids), n, arrays))
            ids.extend([self.image_token_id] * n)
            row += patches
            cursor = at + 1
        ids.extend(prompt_token_ids[cursor:])
        return ids, features

"""Gemma 3: each `<start_of_image>` of a prompt becomes transformers' Gemma3Processor text
for one image, "\\n\\n<start_of_image>" + mm_tokens_per_image "<image_soft_token>" +
"<end_of_image>\\n\\n" (pan-and-scan off: one whole image resized to the tower's size). The
markers and newlines stay text; a feature's span is the soft tokens alone, each filled by an
encoder output."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.multimodal.inputs import MultiModalFeature, make_feature
from shoal.multimodal.processors.base import expand_placeholders


class Gemma3Processor:
    image_placeholder = "<start_of_image>"

    def __init__(self, folder: Any, hf_config: Any, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(str(folder))
        self.tokenizer = tokenizer
        # the checkpoint's whole config, also when handed the engine's flattened one
        config = getattr(hf_config, "multimodal_config", None) or hf_config
        self.boi_id = int(config.boi_token_index)
        self.image_token_id = int(config.image_token_index)
        self.num_tokens = int(config.mm_tokens_per_image)
        self.layout = self._layout(int(config.eoi_token_index))
        self.first = self.layout.index(self.image_token_id)

    def _layout(self, eoi_id: int) -> list[int]:
        """The token ids of one image's text, tokenized whole so that the newlines merge as
        transformers' tokenization of the expanded prompt merges them."""
        boi, eoi, soft = self.tokenizer.convert_ids_to_tokens(
            [self.boi_id, eoi_id, self.image_token_id])
        text = f"\n\n{boi}{soft * self.num_tokens}{eoi}\n\n"
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        first = ids.index(self.image_token_id) if self.image_token_id in ids else -1
        run = ids[first:first + self.num_tokens] if first >= 0 else []
        if ids.count(self.image_token_id) != self.num_tokens or set(run) != {self.image_token_id}:
            raise ValueError(f"the tokenizer does not turn {self.num_tokens} {soft} into one run "
                             f"of token {self.image_token_id}")
        return ids

    def _pixels(self, image: Any) -> np.ndarray:
        """[1, 3, H, W] float32: one image on its own (its content hash is its own)."""
        out = self.image_processor(images=[image], return_tensors="np", do_pan_and_scan=False)
        crops = out.get("num_crops")
        if crops is not None and int(np.asarray(crops).sum()):
            raise ValueError("pan-and-scan crops are not supported")
        return np.asarray(out["pixel_values"], dtype=np.float32)[:1]

    def process(self, prompt_token_ids: list[int], images: list[Any]
                ) -> tuple[list[int], list[MultiModalFeature]]:
        def expand(image: Any, offset: int) -> tuple[list[int], MultiModalFeature]:
            return self.layout, make_feature("gemma3", "image", offset + self.first,
                                             self.num_tokens,
                                             {"pixel_values": self._pixels(image)})

        return expand_placeholders(prompt_token_ids, self.boi_id, images,
                                   self.image_placeholder, expand)

"""Idefics3 (SmolVLM): each `<image>` of a prompt becomes the tiled layout of transformers'
Idefics3Processor. An image is resized and cut into a grid of square tiles plus a downscaled
global view; each tile fills image_seq_len `<image>` tokens, announced by
`<fake_token_around_image><row_i_col_j>` (the global one by `<global-img>`), with newlines
after each grid row. The markers are text the model reads, so a feature's span holds them
and its embed_mask marks the `<image>` positions the encoder fills."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.multimodal.inputs import MultiModalFeature, make_feature
from shoal.multimodal.processors.base import expand_placeholders

FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TAG = "<global-img>"


def expansion_text(rows: int, cols: int, image_seq_len: int, image_token: str = "<image>",
                   ) -> str:
    """The text one image stands for, given its grid of tiles (0 x 0: not split)."""
    tile = image_token * image_seq_len
    global_part = f"{FAKE_TOKEN}{GLOBAL_TAG}{tile}{FAKE_TOKEN}"
    if rows == 0 and cols == 0:
        return global_part
    lines = ["".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols))
             for r in range(rows)]
    # every grid row ends in a newline, and one more separates the global view
    return "".join(line + "\n" for line in lines) + "\n" + global_part


class Idefics3Processor:
    image_placeholder = "<image>"

    def __init__(self, folder: Any, hf_config: Any, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(str(folder))
        self.tokenizer = tokenizer
        # the checkpoint's whole config, also when handed the engine's flattened one
        config = getattr(hf_config, "multimodal_config", None) or hf_config
        self.image_token_id = int(config.image_token_id)
        vision = config.vision_config
        # tokens per tile: the patch grid, pixel-shuffled by scale_factor in each direction
        self.patch, self.scale = int(vision.patch_size), int(config.scale_factor)
        self.image_seq_len = (vision.image_size // self.patch) ** 2 // self.scale ** 2
        self._layouts: dict[tuple[int, int], list[int]] = {}

    def layout_ids(self, rows: int, cols: int) -> list[int]:
        """The token ids of one image's expansion. The whole text is tokenized at once (not
        piece by piece) so that the newlines merge as transformers' tokenization of the
        expanded prompt merges them ("\\n\\n" is one token in SmolVLM's vocabulary)."""
        ids = self._layouts.get((rows, cols))
        if ids is None:
            text = expansion_text(rows, cols, self.image_seq_len, self.image_placeholder)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            want = (rows * cols + 1) * self.image_seq_len
            got = ids.count(self.image_token_id)
            if got != want:
                raise ValueError(f"the tokenizer turns an image's {want} {self.image_placeholder}"
                                 f" tokens into {got} token(s) of id {self.image_token_id}")
            self._layouts[(rows, cols)] = ids
        return ids

    def _process_image(self, image: Any) -> tuple[dict[str, np.ndarray], int, int]:
        """One image on its own (its arrays, hence its content hash, do not depend on the
        other images of the prompt): pixel_values [tiles, 3, H, W] and the pixel mask
        [tiles, H, W] (1 = a real pixel), tiles in prompt order, the global view last."""
        out = self.image_processor(images=[image], return_tensors="np",
                                   return_row_col_info=True)
        arrays = {"pixel_values": np.asarray(out["pixel_values"][0], dtype=np.float32),
                  # bool: an eighth of the int64 the image processor returns
                  "pixel_attention_mask": np.asarray(out["pixel_attention_mask"][0]) != 0}
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        tiles, _, h, w = arrays["pixel_values"].shape
        per_tile = (h // self.patch // self.scale) * (w // self.patch // self.scale)
        if tiles != rows * cols + 1 or per_tile != self.image_seq_len:
            # the model would fill a different number of positions than the prompt holds
            raise ValueError(f"{tiles} tile(s) of {h} x {w} for a {rows} x {cols} grid do not "
                             f"give {self.image_seq_len} tokens a tile (is max_image_size "
                             "the vision tower's image_size?)")
        return arrays, rows, cols

    def process(self, prompt_token_ids: list[int], images: list[Any]
                ) -> tuple[list[int], list[MultiModalFeature]]:
        def expand(image: Any, offset: int) -> tuple[list[int], MultiModalFeature]:
            arrays, rows, cols = self._process_image(image)
            layout = self.layout_ids(rows, cols)
            first = layout.index(self.image_token_id)
            last = len(layout) - 1 - layout[::-1].index(self.image_token_id)
            mask = bytes(int(t == self.image_token_id) for t in layout[first:last + 1])
            return layout, make_feature("idefics3", "image", offset + first,
                                        last - first + 1, arrays, mask)

        return expand_placeholders(prompt_token_ids, self.image_token_id, images,
                                   self.image_placeholder, expand)

"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): the Qwen2 decoder with M-RoPE, and its
vision tower (shoal/models/vision/qwen2_5_vl.py), whose merged patch features fill the
<|image_pad|> positions of the prompt (shoal/multimodal/processors/qwen_vl.py expands them).

The engine's hf_config is the text config, flattened (shoal/loader/multimodal_config.py);
`multimodal_config` is the checkpoint's whole config. Tensor names: transformers 5's
(model.language_model.*, model.visual.*, lm_head.*) and the released checkpoints' older
layout (model.*, visual.*, lm_head.*) both load."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import torch

from shoal.layers.mrope import get_mrope
from shoal.models.llama import Qwen2ForCausalLM
from shoal.models.vision.qwen2_5_vl import Qwen2_5_VisionTransformer

_LANGUAGE = "model.language_model."
_VISION = ("model.visual.", "visual.")


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    supports_multimodal: ClassVar[bool] = True
    uses_mrope: ClassVar[bool] = True

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__(hf_config, dtype, use_triton_ops=use_triton_ops)
        attn = self.model.layers[self.model.start_layer].self_attn
        rope = get_mrope(hf_config, attn.head_dim, use_triton_ops)
        for layer in self.model.layers[self.model.start_layer:self.model.end_layer]:
            layer.self_attn.rotary_emb = rope
        vision = hf_config.multimodal_config.vision_config
        self.visual = Qwen2_5_VisionTransformer(vision, dtype)
        self.merge = int(vision.spatial_merge_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata, inputs_embeds=inputs_embeds)

    # ---- images -----------------------------------------------------------------------------
    def embed_multimodal(self, features: list[Any]) -> list[torch.Tensor]:
        """The tower runs once over all the features' patches (one attention segment per
        image inside it)."""
        if not features:
            return []
        device = self.model.embed_tokens.weight.device
        arrays = [f.arrays() for f in features]
        # (the arrays view msgpack's read-only bytes: copied once into torch)
        pixels = torch.cat([torch.from_numpy(a["pixel_values"].copy()) for a in arrays])
        grids = torch.cat([torch.from_numpy(a["image_grid_thw"].copy()).reshape(-1, 3)
                           for a in arrays])
        out = self.visual(pixels.to(device), grids.to(device))
        sizes = [int(g.prod()) // self.merge ** 2 for g in grids]
        return list(out.split(sizes))

    def embed_input_ids(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)
        if mm_embeds is not None and is_multimodal is not None:
            embeds = embeds.index_put((is_multimodal,), mm_embeds.to(embeds.dtype))
        return embeds

    def get_mrope_positions(self, prompt_token_ids: list[int], features: list[Any]
                            ) -> tuple[torch.Tensor, int]:
        """Text runs count up on all three streams; an image's merged patches take (0, row,
        column) after the text before it; the text after an image starts past the largest
        position so far (transformers' get_rope_index, images only)."""
        parts: list[np.ndarray] = []
        cursor, start = 0, 0
        for f in sorted(features, key=lambda f: f.offset):
            text = f.offset - cursor
            parts.append(np.tile(np.arange(text) + start, (3, 1)))
            t, h, w = (int(x) for x in np.asarray(f.arrays()["image_grid_thw"]).reshape(3))
            h, w = h // self.merge, w // self.merge
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            grid = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + start + text
            parts.append(grid)
            start = int(grid.max()) + 1
            cursor = f.offset + f.length
        parts.append(np.tile(np.arange(len(prompt_token_ids) - cursor) + start, (3, 1)))
        positions = np.concatenate(parts, axis=1)
        delta = int(positions.max()) + 1 - len(prompt_token_ids)
        return torch.from_numpy(positions.astype(np.int64)), delta

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        vision: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                prefix = next((p for p in _VISION if name.startswith(p)), None)
                if prefix is not None:
                    vision.append((name[len(prefix):], tensor))
                elif name.startswith(_LANGUAGE):
                    yield "model." + name[len(_LANGUAGE):], tensor
                else:
                    yield name, tensor

        loaded = super().load_weights(text())
        loaded |= {"visual." + n for n in self.visual.load_weights(vision)}
        return loaded

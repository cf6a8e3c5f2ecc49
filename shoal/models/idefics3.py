"""Idefics3 (SmolVLM; Idefics3ForConditionalGeneration): a SigLIP vision tower
(shoal/models/vision/siglip.py), a connector that folds each scale x scale block of patch
features into one token (pixel shuffle) and projects it to the text width, and shoal's Llama
decoder. Each tile of an image (shoal/multimodal/processors/idefics3.py cuts them) becomes
(image_size / patch / scale)^2 tokens that fill its `<image>` positions.

hf_config is transformers' Idefics3Config, or the engine's flattened text config whose
`multimodal_config` is that whole config (shoal/loader/multimodal_config.py). Parameter
names are the checkpoint's (model.vision_model.*, model.connector.*, model.text_model.*,
lm_head.*); q/k/v and gate/up load into fused parameters. One pipeline stage only."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from shoal.models.llama import LlamaModel
from shoal.models.vision.siglip import SiglipVisionTransformer, patch_attention_mask
from shoal.models.vlm_common import TowerVLM, vlm_configs

_VISION = "model.vision_model."


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(vision_hidden * scale * scale, text_hidden,
                                                  bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """x [n, gh * gw, Dv] row-major patch features -> [n, (gh/s) * (gw/s), Dt]: output
        token (i, j) concatenates the features of patches (i*s + r, j*s + c) over the block's
        rows r, then columns c (the order the projection was trained on)."""
        n, _, d = x.shape
        (gh, gw), s = grid, self.scale
        if gh % s or gw % s:
            raise ValueError(f"a {gh} x {gw} patch grid does not divide by scale_factor {s}")
        x = x.view(n, gh // s, s, gw // s, s, d).permute(0, 1, 3, 2, 4, 5)
        return self.modality_projection.proj(x.reshape(n, (gh // s) * (gw // s), s * s * d))


class Idefics3Model(nn.Module):
    def __init__(self, config: Any, text_config: Any, dtype: torch.dtype,
                 use_triton_ops: bool) -> None:
        super().__init__()
        vision = config.vision_config
        self.vision_model = SiglipVisionTransformer(vision, dtype)
        self.connector = Idefics3Connector(vision.hidden_size, text_config.hidden_size,
                                           int(config.scale_factor), dtype)
        self.text_model = LlamaModel(text_config, dtype, use_triton_ops=use_triton_ops)


class Idefics3ForConditionalGeneration(TowerVLM):
    label: ClassVar[str] = "Idefics3"
    vision_prefix: ClassVar[str] = _VISION

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__()
        config, text = vlm_configs(hf_config, self.label)
        self.config = text
        self.hidden_size = text.hidden_size
        self.image_token_id = int(config.image_token_id)
        self.patch_size = int(config.vision_config.patch_size)
        self.model = Idefics3Model(config, text, dtype, use_triton_ops)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tied_head(text, dtype)

    def text_model(self) -> nn.Module:
        return self.model.text_model

    def vision_tower(self) -> nn.Module:
        return self.model.vision_model

    # ---- images -----------------------------------------------------------------------------
    def embed_multimodal(self, features: list[Any]) -> list[torch.Tensor]:
        """Each feature's tiles -> [tiles * tokens_per_tile, hidden], tiles in order. The
        tower runs once over the tiles of all features when they share one size (they do
        when the image processor pads tiles to max_image_size), else once per size."""
        if not features:
            return []
        device = self.model.text_model.embed_tokens.weight.device
        arrays = [f.arrays() for f in features]
        out: list[torch.Tensor | None] = [None] * len(arrays)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, a in enumerate(arrays):
            groups.setdefault(tuple(a["pixel_values"].shape[1:]), []).append(i)
        for members in groups.values():
            pixels = torch.cat([torch.tensor(arrays[i]["pixel_values"]) for i in members])
            masks = [arrays[i].get("pixel_attention_mask") for i in members]
            pixel_mask = (None if any(m is None for m in masks)
                          else torch.cat([torch.tensor(m) for m in masks]).to(device))
            embeds = self.encode_tiles(pixels.to(device), pixel_mask)
            sizes = [arrays[i]["pixel_values"].shape[0] for i in members]
            for i, e in zip(members, embeds.split(sizes)):
                out[i] = e.reshape(-1, e.shape[-1])
        return [e for e in out if e is not None]

    def encode_tiles(self, pixels: torch.Tensor,
                     pixel_mask: torch.Tensor | None) -> torch.Tensor:
        """pixels [n, 3, H, W], pixel_mask [n, H, W] (nonzero: a real pixel) or None ->
        [n, tokens_per_tile, hidden]."""
        p = self.patch_size
        patch_mask = None if pixel_mask is None else patch_attention_mask(pixel_mask, p)
        feats = self.model.vision_model(pixels, patch_mask)
        return self.model.connector(feats, (pixels.shape[2] // p, pixels.shape[3] // p))

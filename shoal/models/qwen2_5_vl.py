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

from shoal.models.llama import Qwen2ForCausalLM
from shoal.models.vision.qwen2_5_vl import Qwen2_5_VisionTransformer
from shoal.models.vlm_common import VideoSpan, install_mrope, load_qwen_vl, mrope_walk, place_rows


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    supports_multimodal: ClassVar[bool] = True
    uses_mrope: ClassVar[bool] = True
    encoder_graphs: Any = None  # set by the runner on CUDA (worker/encoder_graphs.py)

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__(hf_config, dtype, use_triton_ops=use_triton_ops)
        install_mrope(self.model, hf_config, use_triton_ops)
        vision = hf_config.multimodal_config.vision_config
        self.visual = Qwen2_5_VisionTransformer(vision, dtype)
        self.merge = int(vision.spatial_merge_size)
        self.tokens_per_second = float(getattr(vision, "tokens_per_second", 2))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata, inputs_embeds=inputs_embeds)

    # ---- images and videos -------------------------------------------------------------------
    def embed_multimodal(self, features: list[Any]) -> list[torch.Tensor]:
        """The tower runs once over all the features' patches (one attention segment per
        image or video frame group inside it). A video's output is whole here: EVS pruning
        is prune_video's, which the runner calls."""
        if not features:
            return []
        device = self.model.embed_tokens.weight.device
        arrays = [_pixels_and_grid(f) for f in features]
        # (the arrays view msgpack's read-only bytes: copied once into torch)
        pixels = [torch.from_numpy(a[0].copy()) for a in arrays]
        grids = torch.cat([torch.from_numpy(a[1].copy()).reshape(-1, 3) for a in arrays])
        graphs = self.encoder_graphs  # CUDA graphs per image grid (worker/encoder_graphs.py)
        if graphs is not None and len(features) == 1:
            out = graphs.run(pixels[0].to(device, non_blocking=True),
                             tuple(int(x) for x in grids[0]))
            if out is not None:
                return [out]
        # (grids stay on the host: the tower reads them in Python once per forward)
        out = self.visual(torch.cat(pixels).to(device), grids)
        sizes = [int(g.prod()) // self.merge ** 2 for g in grids]
        return list(out.split(sizes))

    def embed_input_ids(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        return place_rows(self.model.embed_tokens(input_ids), mm_embeds, is_multimodal)

    def prune_video(self, feature: Any, embeds: torch.Tensor) -> VideoSpan:
        """EVS of a video's tower output: the kept rows and their positions relative to the
        video's first token [3, kept], in the original order; the first frame whole. The
        span is pads alone, pruned or not: the model reads the prompt's ids."""
        arrays = feature.arrays()
        rel = torch.from_numpy(self.vision_positions(feature))
        rate = float(arrays.get("video_pruning_rate", np.zeros(1)).reshape(-1)[0])
        if feature.modality != "video" or rate <= 0:
            return VideoSpan(embeds, rel)
        t, h, w = (int(x) for x in arrays["video_grid_thw"].reshape(3))
        keep = evs_keep_mask(embeds, (t, h // self.merge, w // self.merge), rate)
        return VideoSpan(embeds[keep.to(embeds.device)], rel[:, keep.cpu()])

    def vision_positions(self, feature: Any) -> np.ndarray:
        """[3, t*h*w] positions of an item's merged patches relative to its first: (time,
        row, column), time scaled for a video by its seconds per temporal step and the
        model's tokens_per_second (quantised after scaling, in float32 as transformers)."""
        arrays = feature.arrays()
        t, h, w = (int(x) for x in _pixels_and_grid(feature)[1].reshape(3))
        h, w = h // self.merge, w // self.merge
        times = np.arange(t)
        if feature.modality == "video":
            seconds = arrays["second_per_grid_t"].reshape(-1)[0]
            step = np.float32(self.tokens_per_second) * seconds
            times = (np.arange(t, dtype=np.float32) * step).astype(np.int64)
        tt, hh, ww = np.meshgrid(times, np.arange(h), np.arange(w), indexing="ij")
        return np.stack([tt.ravel(), hh.ravel(), ww.ravel()]).astype(np.int64)

    def get_mrope_positions(self, prompt_token_ids: list[int], features: list[Any]
                            ) -> tuple[torch.Tensor, int]:
        """Text runs count up on all three streams; an item's merged patches take (time,
        row, column) after the text before it; the text after it starts past its largest
        position (Qwen's and vLLM's get_rope_index; transformers 5.25 starts it at the
        largest row or column instead, which differs for long videos). A pruned video (EVS:
        fewer tokens than patches) takes its first tokens' positions until the runner knows
        which it kept; the text after it counts from the whole grid either way."""
        def place(f: Any, start: int) -> tuple[np.ndarray, int]:
            grid = self.vision_positions(f) + start
            return grid[:, :f.length], int(grid.max()) + 1

        return mrope_walk(len(prompt_token_ids), features, place)

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_qwen_vl(self, weights, super().load_weights)


def _pixels_and_grid(feature: Any) -> tuple[np.ndarray, np.ndarray]:
    a = feature.arrays()
    if feature.modality == "video":
        return a["pixel_values_videos"], a["video_grid_thw"]
    return a["pixel_values"], a["image_grid_thw"]


def evs_keep_mask(embeds: torch.Tensor, grid: tuple[int, int, int], rate: float
                  ) -> torch.Tensor:
    """vLLM's EVS retention mask over a video's [t*h*w, D] merged tokens (grid: merged t, h,
    w): every token of the first frame, then the tokens least like the same place in the
    previous frame (cosine), retained_count of them in all; ties keep the earlier token."""
    from shoal.multimodal.video import retained_count

    t, h, w = grid
    x = embeds.float().reshape(t, h, w, -1)
    dissimilar = 1 - torch.nn.functional.cosine_similarity(x[1:], x[:-1], dim=-1)
    first = torch.full_like(x[:1, ..., 0], 255.0)  # above any dissimilarity (at most 2)
    order = torch.argsort(torch.cat([first, dissimilar]).reshape(-1), descending=True,
                          stable=True)
    keep = torch.zeros(t * h * w, dtype=torch.bool, device=embeds.device)
    keep[order[:retained_count(h * w, t, rate)]] = True
    return keep

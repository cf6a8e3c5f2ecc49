"""Qwen2.5-VL / Qwen3-VL prompts: each image's single <|image_pad|> token (and each video's
<|video_pad|>) becomes one token per merged patch group (grid t * h * w / merge^2) of the
processed pixels, between the <|vision_start|> and <|vision_end|> the prompt (or chat part)
already holds.

Images go through transformers' image processor. Videos are preprocessed here (transformers'
video processors need torchvision): frames resized by the image processor's smart_resize rule
(the video config's pixel limits where the checkpoint has one), normalised, grouped by
temporal_patch_size (the last frame repeated to fill a group) and flattened in the layout of
transformers' Qwen2-VL video processor. With EVS (video_pruning_rate > 0) a video emits only
the pads of the tokens it keeps (video.retained_count; the rate is in the arrays, so in
the content hash that keys the encoder cache). Qwen3-VL's videos (timestamps between
frames) are qwen3_vl.py's, on this class."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shoal.multimodal.inputs import MultiModalFeature, make_feature
from shoal.multimodal.video import Video, retained_count


@dataclass(frozen=True)
class Expansion:
    """What one placeholder becomes: `tokens` replace it (with the <|vision_start|> and
    <|vision_end|> around it when `wrapped`); the item's feature spans tokens[first:last]
    (None: to the end), embed_mask marking the positions its encoder outputs fill."""

    modality: str
    arrays: dict[str, np.ndarray]
    tokens: list[int]
    first: int = 0
    last: int | None = None
    embed_mask: bytes | None = None
    wrapped: bool = False
    encoder_tokens: int | None = None  # EVS: the tower's tokens, more than the span keeps


def load_image_processor(folder: Any) -> Any:
    """transformers' image processor of the checkpoint (its PIL flavour where torchvision is
    missing, which transformers picks itself)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(Path(folder)), local_files_only=True)


def find_placeholders(ids: list[int], token: int, count: int, name: str) -> list[int]:
    """Indices of the prompt's `count` placeholder tokens; ValueError when they differ."""
    where = [i for i, t in enumerate(ids) if t == token]
    if len(where) != count:
        kind = "video" if "video" in name else "image"
        raise ValueError(f"the prompt has {len(where)} {name} placeholders for {count} "
                         f"{kind}(s): put one {name} in the prompt per {kind}")
    return where


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """Qwen-VL's resize target: both sides multiples of `factor`, the area within the
    limits, the aspect ratio kept (transformers' smart_resize)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video's aspect ratio must be under 200, got {width}x{height}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _pixel_limits(folder: Any, image_processor: Any) -> tuple[int, int]:
    """(min, max) pixels of a video frame: video_preprocessor_config.json's where the
    checkpoint has one, else the image processor's."""
    path = Path(folder) / "video_preprocessor_config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        size = cfg.get("size") or {}
        lo = cfg.get("min_pixels") or size.get("shortest_edge")
        hi = cfg.get("max_pixels") or size.get("longest_edge")
        if lo and hi:
            return int(lo), int(hi)
    size = image_processor.size
    return int(size.shortest_edge), int(size.longest_edge)


class QwenVLProcessor:
    supports_evs = True
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    kind = "qwen_vl"

    def __init__(self, folder: Any, hf_config: Any, tokenizer: Any) -> None:
        self.image_processor = load_image_processor(folder)
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(getattr(self.image_processor, "merge_size", 2))
        self.video_pruning_rate = 0.0  # the engine's, set by the frontend
        # Qwen2.5-VL's videos; Qwen3-VL's (timestamps between frames) are its subclass's
        video_token = getattr(hf_config, "video_token_id", None)
        self.video_placeholder: str | None = None
        if video_token is not None and getattr(hf_config, "model_type", "") == "qwen2_5_vl":
            self.video_placeholder = "<|vision_start|><|video_pad|><|vision_end|>"
            self.video_token_id = int(video_token)
            self.video_pixels = _pixel_limits(folder, self.image_processor)

    def process(self, prompt_token_ids: list[int], images: list[Any],
                videos: Sequence[Video] = ()) -> tuple[list[int], list[MultiModalFeature]]:
        where = find_placeholders(prompt_token_ids, self.image_token_id, len(images),
                                  "<|image_pad|>")
        items: dict[int, Expansion] = {}
        if images:
            out = self.image_processor(images=images, return_tensors="np")
            pixels, grids = np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])
            row = 0
            for at, grid in zip(where, grids):
                patches = int(grid.prod())
                arrays = {"pixel_values": pixels[row:row + patches], "image_grid_thw": grid}
                items[at] = Expansion("image", arrays,
                                      [self.image_token_id] * (patches // self.merge ** 2))
                row += patches
        if videos:
            if self.video_placeholder is None:
                raise ValueError("this model does not take videos")
            for at, video in zip(find_placeholders(prompt_token_ids, self.video_token_id,
                                                   len(videos), "<|video_pad|>"), videos):
                items[at] = self.video_item(video, prompt_token_ids, at)
        return self._expand(prompt_token_ids, items)

    def _expand(self, prompt_token_ids: list[int], items: dict[int, Expansion]
                ) -> tuple[list[int], list[MultiModalFeature]]:
        """Each placeholder at a key of `items` replaced by its expansion, in prompt order."""
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        cursor = 0
        for at in sorted(items):
            e = items[at]
            lo, hi = (at - 1, at + 2) if e.wrapped else (at, at + 1)
            ids.extend(prompt_token_ids[cursor:lo])
            last = len(e.tokens) if e.last is None else e.last
            features.append(make_feature(self.kind, e.modality, len(ids) + e.first,
                                         last - e.first, e.arrays, e.embed_mask,
                                         e.encoder_tokens))
            ids.extend(e.tokens)
            cursor = hi
        ids.extend(prompt_token_ids[cursor:])
        return ids, features

    def video_item(self, video: Video, prompt_token_ids: list[int], at: int) -> Expansion:
        """A video's pads: one per merged patch group (those EVS keeps)."""
        pixels, grid = self.video_pixels_of(video.frames)
        tps = int(self.image_processor.temporal_patch_size)
        rate = float(self.video_pruning_rate)
        arrays = {"pixel_values_videos": pixels, "video_grid_thw": grid,
                  "second_per_grid_t": np.asarray([tps / video.fps], dtype=np.float32),
                  "video_pruning_rate": np.asarray([rate], dtype=np.float32)}
        per_frame = int(grid[1] * grid[2]) // self.merge ** 2
        n = retained_count(per_frame, int(grid[0]), rate)
        return Expansion("video", arrays, [self.video_token_id] * n,
                         encoder_tokens=per_frame * int(grid[0]) if rate > 0 else None)

    def video_pixels_of(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[T, H, W, 3] uint8 frames -> (patches [t*h*w, C*tps*p*p] float32, grid (t, h, w))."""
        ip = self.image_processor
        height, width = frames.shape[1:3]
        size = smart_resize(height, width, int(ip.patch_size) * self.merge, *self.video_pixels)
        return video_patches(frames, size, ip, self.merge)


def video_patches(frames: np.ndarray, size: tuple[int, int], ip: Any, merge: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """[T, H, W, 3] uint8 frames resized to size (h, w), rescaled and normalised by `ip`'s
    settings (patch_size, temporal_patch_size, rescale_factor, image_mean, image_std,
    resample), the last frame repeated to fill the last temporal group, flattened in
    transformers' Qwen-VL video layout: (patches [t*h*w, C*tps*p*p] float32, grid (t, h, w))."""
    patch, tps = int(ip.patch_size), int(ip.temporal_patch_size)
    h, w = size
    if (h, w) != tuple(frames.shape[1:3]):
        from PIL import Image

        frames = np.stack([np.asarray(Image.fromarray(f).resize((w, h), int(ip.resample)))
                           for f in frames])
    x = frames.astype(np.float32) * np.float32(ip.rescale_factor)
    mean, std = np.asarray(ip.image_mean, np.float32), np.asarray(ip.image_std, np.float32)
    x = ((x - mean) / std).transpose(0, 3, 1, 2)  # [T, C, h, w]
    if pad := -len(x) % tps:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    gt, gh, gw, c = len(x) // tps, h // patch, w // patch, x.shape[1]
    x = x.reshape(gt, tps, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixels = np.ascontiguousarray(x.reshape(gt * gh * gw, c * tps * patch * patch))
    return pixels, np.asarray([gt, gh, gw], dtype=np.int64)

"""Qwen3-VL prompts: images as Qwen2.5-VL's (qwen_vl.py); a video as transformers 5.25's
Qwen3VLProcessor and Qwen3VLVideoProcessor make it.

- Frames: sampled at the video config's fps (2) from the source's frame rate, at least
  min_frames and at most max_frames (np.linspace over the clip, rounded), resized so that all
  frames together stay within the config's pixel budget (Qwen3-VL's smart_resize counts the
  frames), normalised, grouped by temporal_patch_size (the last frame repeated) and
  flattened in the Qwen-VL patch layout.
- Prompt: each temporal group becomes `<{t:.1f} seconds><|vision_start|>` + one
  <|video_pad|> per merged patch of the frame + `<|vision_end|>`, t the mean second of the
  group's first and last frame. A prompt's `<|vision_start|><|video_pad|><|vision_end|>`
  is replaced whole (transformers collapses that wrapper first); a bare <|video_pad|> alone.
  The timestamps are tokenized on their own, as vLLM does.
- Feature: one per video, spanning its first to its last pad; embed_mask marks the pads
  (the timestamps and frame markers between are text), so the encoder runs once a video.
- EVS (video_pruning_rate > 0): which tokens of a frame survive is known only once the tower
  has run, so the prompt holds just the kept count of pads (video.retained_count), laid out
  by video.planned_counts, and the feature (from the first pad to the closing
  <|vision_end|>, no embed_mask: every position takes an encoder row) carries the rate and
  the texts between frames (frame_text_ids, one frame_text_lens entry per gap); the model
  lays the span out (models/qwen3_vl_video.py).

No torch here: the video config is read from the checkpoint's JSON with the class defaults
of transformers' Qwen3VLVideoProcessor (importing it would import torch)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from shoal.multimodal.processors.qwen_vl import Expansion, QwenVLProcessor, video_patches
from shoal.multimodal.video import Video, planned_counts, retained_count

_UNKNOWN_FPS = 24.0  # what transformers assumes of a video without a frame rate


@dataclass(frozen=True)
class VideoConfig:
    """video_preprocessor_config.json of a Qwen3-VL checkpoint (defaults: transformers 5.25's
    Qwen3VLVideoProcessor). Attribute names follow the image processor's, so video_patches
    reads it as one."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: int = 3  # bicubic
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def load(cls, folder: Any) -> VideoConfig:
        path = Path(folder) / "video_preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in cfg.items() if k in names and v is not None}
        size = cfg.get("size") or {}
        if size.get("shortest_edge"):
            kw["min_pixels"] = size["shortest_edge"]
        if size.get("longest_edge"):
            kw["max_pixels"] = size["longest_edge"]
        for key in ("image_mean", "image_std"):
            if key in kw:
                kw[key] = tuple(float(x) for x in kw[key])
        if cfg.get("do_rescale") is False:
            kw["rescale_factor"] = 1.0
        if cfg.get("do_normalize") is False:
            kw["image_mean"], kw["image_std"] = (0.0,) * 3, (1.0,) * 3
        return cls(**kw)


def video_size(num_frames: int, height: int, width: int, temporal: int, factor: int,
               min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's resize target of a video's frames: sides multiples of `factor`, all frames
    together within [min_pixels, max_pixels] (transformers' video smart_resize)."""
    if num_frames < temporal:
        raise ValueError(f"a Qwen3-VL video needs at least {temporal} frames, got "
                         f"{num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video's aspect ratio must be under 200, got {width}x{height}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(num_frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def group_times(times: np.ndarray, temporal: int) -> list[float]:
    """The second of each temporal group: the mean of its first and last frame's (the last
    frame repeated to fill the last group), as transformers' _calculate_timestamps."""
    t = list(times)
    t += [t[-1]] * (-len(t) % temporal)
    return [(t[i] + t[i + temporal - 1]) / 2 for i in range(0, len(t), temporal)]


class Qwen3VLProcessor(QwenVLProcessor):
    supports_evs = True  # frames laid out after the tower: models/qwen3_vl_video.py

    def __init__(self, folder: Any, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(folder, hf_config, tokenizer)
        self.tokenizer = tokenizer
        self.video_config = VideoConfig.load(folder)
        self.video_placeholder = "<|vision_start|><|video_pad|><|vision_end|>"
        self.video_token_id = int(hf_config.video_token_id)
        self.vision_start_id = int(hf_config.vision_start_token_id)
        self.vision_end_id = int(hf_config.vision_end_token_id)
        self._stamps: dict[str, list[int]] = {}

    def sample_frames(self, total: int, source_fps: float, max_frames: int) -> list[int]:
        """The frames a decoded video keeps (transformers' Qwen3VLVideoProcessor.sample_frames
        at the config's fps, also capped by the server's max_frames)."""
        cfg = self.video_config
        rate = source_fps if source_fps > 0 else _UNKNOWN_FPS
        n = int(total / rate * cfg.fps)
        n = max(1, min(max(n, cfg.min_frames), cfg.max_frames, total, max_frames))
        return np.linspace(0, total - 1, n).round().astype(int).tolist()

    def video_item(self, video: Video, prompt_token_ids: list[int], at: int) -> Expansion:
        cfg, frames = self.video_config, video.frames
        pixels, grid = video_patches(frames, self._frame_size(frames), cfg, self.merge)
        per_frame = int(grid[1] * grid[2]) // self.merge ** 2
        stamps = [self._timestamp(s)
                  for s in group_times(video.frame_times(), cfg.temporal_patch_size)]
        rate = float(self.video_pruning_rate)
        counts = [per_frame] * len(stamps)
        if rate > 0:  # EVS: as many pads as it keeps, laid out for now as planned_counts
            counts = planned_counts(per_frame, len(stamps),
                                    retained_count(per_frame, len(stamps), rate))
        tokens: list[int] = []
        mask: list[int] = []
        for stamp, n in zip(stamps, counts):
            tokens += [*stamp, self.vision_start_id, *[self.video_token_id] * n,
                       self.vision_end_id]
            mask += [0] * (len(stamp) + 1) + [1] * n + [0]
        first, last = mask.index(1), len(mask) - 1  # the first frame is never pruned
        span = mask[first:last]
        wrapped = (0 < at < len(prompt_token_ids) - 1
                   and prompt_token_ids[at - 1] == self.vision_start_id
                   and prompt_token_ids[at + 1] == self.vision_end_id)
        arrays = {"pixel_values_videos": pixels, "video_grid_thw": grid}
        embed_mask = bytes(span) if 0 in span else None
        if rate > 0:
            # Which frame a kept token belongs to is known only once the tower has run, so
            # every position of the span takes an encoder row (prune_video lays the frames
            # out: kept tokens, and the embeddings of these texts between frames)
            between = [t for t, m in zip(tokens[first:last], span) if not m]
            arrays |= {"video_pruning_rate": np.asarray([rate], dtype=np.float32),
                       "frame_text_ids": np.asarray(between, dtype=np.int64),
                       "frame_text_lens": np.asarray([len(s) + 2 for s in stamps[1:]],
                                                     dtype=np.int64)}
            embed_mask = None
        return Expansion("video", arrays, tokens, first, last, embed_mask, wrapped,
                         encoder_tokens=per_frame * len(stamps) if rate > 0 else None)

    def _frame_size(self, frames: np.ndarray) -> tuple[int, int]:
        cfg = self.video_config
        t, height, width = frames.shape[:3]
        factor = cfg.patch_size * cfg.merge_size
        max_pixels = cfg.max_pixels
        if cfg.cap_pixels_per_frame:  # qwen-vl-utils' per-frame cap (the config opts in)
            per_frame = max(min(cfg.max_video_tokens * factor * factor, cfg.max_pixels // t),
                            int(cfg.min_pixels * 1.05))
            max_pixels = per_frame * t
        return video_size(t, height, width, cfg.temporal_patch_size, factor, cfg.min_pixels,
                          max_pixels)

    def _timestamp(self, second: float) -> list[int]:
        text = f"<{second:.1f} seconds>"
        ids = self._stamps.get(text)
        if ids is None:
            ids = self._stamps[text] = list(self.tokenizer.encode(text,
                                                                  add_special_tokens=False))
        return ids

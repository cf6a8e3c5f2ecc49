"""A Qwen3-VL image or video span in the prompt: its M-RoPE positions, and EVS pruning of a
video's span (whose frame groups' pads are separated by text: a frame's <|vision_end|>, the
next frame's timestamp and <|vision_start|>).

Positions (transformers' Qwen3-VL get_rope_index, which splits a video into its frame
groups): a frame's h*w pads take (start, start + row, start + column) and the token after
them starts at start + max(h, w); a text token takes (start, start, start), the next one
start + 1.

EVS (video_pruning_rate > 0; the processor's feature carries the rate and the texts
between frames): the tower's output keeps the tokens evs_keep_mask picks over the whole
video, so how many each frame keeps is known only then. The pruned span is the unpruned one
with the dropped pads taken out: every text token stays, every kept token keeps the position
it has unpruned, and the text after the video starts where it would unpruned. Its rows are
the kept tower rows at the pads and the token embeddings of the texts (zero deepstack
there), so every position of the span takes an encoder row. The prompt keeps the planned
layout's ids, so at some span positions the model reads another id than the prompt's
(span_ids): the runner leaves those positions' prompt logprobs None (worker/mm_step.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shoal.multimodal.video import planned_counts, retained_count


def span_positions(grid: tuple[int, int, int], mask: Sequence[int], start: int,
                   label: str = "video") -> tuple[np.ndarray, int]:
    """[3, len(mask)] positions of a span whose mask marks frame pads (1) and text (0), when
    it starts at `start`, and where the token after it starts. grid: merged (t, h, w).
    ValueError when the pads are not t whole frames of h*w."""
    t, h, w = grid
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    frame = np.stack([np.zeros(h * w, np.int64), hh.ravel(), ww.ravel()])
    parts: list[np.ndarray] = []
    i = frames = 0
    while i < len(mask):
        if mask[i]:  # a frame group's h*w pads, all together
            if i + h * w > len(mask) or not all(mask[i:i + h * w]):
                raise ValueError(f"{label} span: a frame of {h * w} tokens is cut")
            parts.append(frame + start)
            start, i, frames = start + max(h, w), i + h * w, frames + 1
        else:
            parts.append(np.full((3, 1), start))
            start, i = start + 1, i + 1
    if frames != t:
        raise ValueError(f"{label} span of {len(mask)} tokens does not fit its grid "
                         f"{t}x{h}x{w}")
    return np.concatenate(parts, axis=1), start


@dataclass(frozen=True)
class PrunedVideo:
    """A video feature under EVS: its merged grid (t, h, w), the pruning rate, and the text
    tokens between its frames (text_lens[i] of text_ids after frame i, for i < t - 1)."""

    grid: tuple[int, int, int]
    rate: float
    text_ids: np.ndarray
    text_lens: np.ndarray

    @classmethod
    def of(cls, feature: Any, merge: int) -> PrunedVideo | None:
        """The feature's EVS layout; None for an image or an unpruned video."""
        a = feature.arrays()
        if feature.modality != "video" or "video_pruning_rate" not in a:
            return None
        rate = float(a["video_pruning_rate"].reshape(-1)[0])
        if rate <= 0:
            return None
        t, h, w = (int(x) for x in a["video_grid_thw"].reshape(3))
        grid = (t, h // merge, w // merge)
        ids, lens = a["frame_text_ids"].reshape(-1), a["frame_text_lens"].reshape(-1)
        if len(lens) != t - 1 or int(lens.sum()) != len(ids) or (lens < 0).any():
            raise ValueError(f"a pruned video of {t} frames needs {t - 1} frame_text_lens "
                             f"summing to its {len(ids)} frame_text_ids")
        return cls(grid, rate, ids.astype(np.int64), lens.astype(np.int64))

    @property
    def tokens_per_frame(self) -> int:
        return self.grid[1] * self.grid[2]

    @property
    def num_kept(self) -> int:
        return retained_count(self.tokens_per_frame, self.grid[0], self.rate)

    def unpruned_mask(self) -> np.ndarray:
        """[U] uint8 over the span unpruned: 1 at the frames' pads, 0 at the texts."""
        parts: list[np.ndarray] = []
        for i in range(self.grid[0]):
            parts.append(np.ones(self.tokens_per_frame, np.uint8))
            if i < self.grid[0] - 1:
                parts.append(np.zeros(int(self.text_lens[i]), np.uint8))
        return np.concatenate(parts)

    def planned_keep(self) -> np.ndarray:
        """[t*h*w] bool: the first tokens of each frame, as many as the prompt's pads
        (video.planned_counts): the span's layout before the tower has run."""
        keep = np.zeros((self.grid[0], self.tokens_per_frame), dtype=bool)
        counts = planned_counts(self.tokens_per_frame, self.grid[0], self.num_kept)
        for frame, n in enumerate(counts):
            keep[frame, :n] = True
        return keep.reshape(-1)

    def layout(self, keep: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(positions [3, L], is_pad [L] bool, where the token after it starts) of the span
        keeping the tower tokens `keep` ([t*h*w] bool, in the tower's order) when it starts
        at `start`: the unpruned span's columns at every text token and every kept pad."""
        mask = self.unpruned_mask()
        positions, end = span_positions(self.grid, mask, start)
        if keep.shape != (int(mask.sum()),):
            raise ValueError(f"keep has shape {keep.shape}; the video has {int(mask.sum())} "
                             "tokens")
        columns = np.ones(len(mask), dtype=bool)
        columns[mask.astype(bool)] = keep
        return positions[:, columns], mask[columns].astype(bool), end

    def span_ids(self, is_pad: np.ndarray, pad_id: int) -> np.ndarray:
        """[L] the token ids a span laid out with pads at is_pad ([L] bool, from layout)
        holds: pad_id at the pads, the texts between frames in order elsewhere."""
        if int((~is_pad).sum()) != len(self.text_ids):
            raise ValueError(f"a pruned span with {int((~is_pad).sum())} text positions; "
                             f"the video has {len(self.text_ids)} text tokens")
        ids = np.full(len(is_pad), pad_id, dtype=np.int64)
        ids[~is_pad] = self.text_ids
        return ids


def span_rows(kept: torch.Tensor, text: torch.Tensor, is_pad: torch.Tensor) -> torch.Tensor:
    """[L, D] rows of a pruned span: the kept tower rows ([n, D]: main features, then the
    deepstack ones) at is_pad, in order, and the text embeddings ([L - n, hidden]) elsewhere,
    with zero deepstack features (the decoder adds those to every row of the span)."""
    rows = kept.new_zeros(len(is_pad), kept.shape[1])
    pad = is_pad.to(kept.device)
    rows[pad] = kept
    rows[~pad, :text.shape[1]] = text.to(rows.dtype)
    return rows

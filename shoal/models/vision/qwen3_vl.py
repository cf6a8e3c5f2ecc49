"""The Qwen3-VL vision tower: 16x16x2 patches plus a learned position table resampled
(bilinear, corners aligned) to each image's grid, 2-D rotary over (h, w), full attention
within each frame, LayerNorm blocks, a merger that folds 2x2 patches into one token, and
deepstack mergers that turn chosen blocks' outputs into extra features for early decoder
layers.

Parameter names and shapes match transformers' `model.visual`, so checkpoint tensors load as
they are once that prefix is stripped."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.models.vision.qwen2_5_vl import (
    _ACTIVATIONS,
    _positions,
    _Segments,
    _segments,
    _VisionAttention,
    load_exact,
)

_EPS = 1e-6


@dataclass
class _Plan:
    """Everything that depends on grid_thw alone, built on the host before the forward (a
    CUDA graph of the tower keeps one per grid: its tensors are the graph's inputs)."""

    positions: torch.Tensor  # [N, 2] (h, w) of each patch, merge order: the rotary's
    inv_freq: torch.Tensor  # [head_dim // 4] rotary frequencies, shared by h and w
    table_rows: torch.Tensor  # [4, N] position-table rows of each patch's bilinear corners
    table_weights: torch.Tensor  # [4, N] fp32 weights of those corners
    frames: _Segments  # full attention within each frame


class _PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride and its input, run as a linear map of the
    flattened patch; the conv-shaped weight keeps checkpoint tensors loadable as they are."""

    def __init__(self, in_channels: int, temporal: int, patch: int, hidden: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(in_channels, hidden, kernel_size=kernel, stride=kernel,
                              bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.reshape(-1, w[0].numel()), w.view(w.shape[0], -1), self.proj.bias)


class _VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {act!r}")
        self.act = _ACTIVATIONS[act]
        self.linear_fc1 = nn.Linear(hidden, intermediate, bias=True, dtype=dtype)
        self.linear_fc2 = nn.Linear(intermediate, hidden, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _VisionBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=_EPS, dtype=dtype)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=_EPS, dtype=dtype)
        self.attn = _VisionAttention(cfg.hidden_size, cfg.num_heads, dtype)
        self.mlp = _VisionMLP(cfg.hidden_size, cfg.intermediate_size,
                              getattr(cfg, "hidden_act", "gelu_pytorch_tanh"), dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seg: _Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seg)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    """LayerNorm, then an MLP over the merge x merge patches of one token. The main merger
    normalises each patch; the deepstack ones (postshuffle) the concatenated group."""

    def __init__(self, hidden: int, out_hidden: int, merge: int, postshuffle: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.merged = hidden * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged if postshuffle else hidden, eps=_EPS, dtype=dtype)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, dtype=dtype)
        self.linear_fc2 = nn.Linear(self.merged, out_hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.postshuffle else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.merged))))


class Qwen3VisionTransformer(nn.Module):
    """pixel patches [N, C*T*P*P] + grid_thw -> (merged tokens [N / merge^2, out_hidden],
    one [N / merge^2, out_hidden] tensor per deepstack block)."""

    def __init__(self, vision_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = vision_config
        self.merge = cfg.spatial_merge_size
        # (Qwen3.5's tower has none: its config lacks the field)
        self.deepstack_indexes = [int(i) for i in getattr(cfg, "deepstack_visual_indexes", ())]
        head_dim = cfg.hidden_size // cfg.num_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0))
        # h and w each get head_dim // 4 frequencies; a plain attribute, not a buffer, so that
        # module.to(bfloat16) cannot round it
        half = head_dim // 2
        self._inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
        self.side = int(cfg.num_position_embeddings ** 0.5)
        self.patch_embed = _PatchEmbed(getattr(cfg, "in_channels", 3), cfg.temporal_patch_size,
                                       cfg.patch_size, cfg.hidden_size, dtype)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size,
                                      dtype=dtype)
        self.blocks = nn.ModuleList(_VisionBlock(cfg, dtype) for _ in range(cfg.depth))
        self.merger = _PatchMerger(cfg.hidden_size, cfg.out_hidden_size, self.merge, False,
                                   dtype)
        self.deepstack_merger_list = nn.ModuleList(
            _PatchMerger(cfg.hidden_size, cfg.out_hidden_size, self.merge, True, dtype)
            for _ in self.deepstack_indexes)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.forward_planned(pixel_values, self.plan(grid_thw))

    def forward_planned(self, pixel_values: torch.Tensor, plan: _Plan
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """forward over a plan made before: no host sync and no shape read from a tensor's
        values, so a CUDA graph can replay it (worker/encoder_graphs.py)."""
        device = self.patch_embed.proj.weight.device
        if pixel_values.shape[0] != plan.positions.shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw "
                             f"describes {plan.positions.shape[0]}")
        x = self.patch_embed(pixel_values.to(device=device, dtype=self.dtype))
        x = x + self._position_embeddings(plan).to(x.dtype)
        freqs = (plan.positions.float()[:, :, None] * plan.inv_freq).flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, plan.frames)
            if i in self.deepstack_indexes:
                merger = self.deepstack_merger_list[self.deepstack_indexes.index(i)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack

    def plan(self, grid_thw: torch.Tensor) -> _Plan:
        """Everything that depends on the grids alone: grid_thw (best on the host: read with
        tolist, the forward's one host sync) to Python, then index tensors to the tower's
        device."""
        device = self.patch_embed.proj.weight.device
        grid = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        if not grid:
            raise ValueError("grid_thw holds no image")
        for t, h, w in grid:
            if t < 1 or h < 1 or w < 1 or h % self.merge or w % self.merge:
                raise ValueError(f"grid {(t, h, w)} is not a positive multiple of the "
                                 f"spatial merge size {self.merge}")
        positions = _positions(grid, self.merge)  # [N, 2] (h, w), merge order
        rows, weights = self._table_corners(grid, positions)
        return _Plan(
            positions=positions.to(device),
            inv_freq=self._inv_freq.to(device),
            table_rows=rows.to(device),
            table_weights=weights.to(device),
            frames=_segments([h * w for t, h, w in grid for _ in range(t)], device),
        )

    def _table_corners(self, grid: list[tuple[int, int, int]], positions: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The side x side learned table resampled to each patch's (row, column) of its
        image's h x w grid: bilinear with corners aligned (row r reads table row
        r * (side - 1) / (h - 1)), as transformers' F.interpolate-equivalent gather. Returns
        the four corners' table rows [4, N] and fp32 weights [4, N]."""
        sizes = torch.tensor([(h, w) for t, h, w in grid]).repeat_interleave(
            torch.tensor([t * h * w for t, h, w in grid]), dim=0)  # [N, 2]
        src = positions.float() * (self.side - 1) / (sizes - 1).clamp(min=1)  # [N, 2]
        lo = src.floor()
        frac = src - lo
        lo = lo.long()
        hi = (lo + 1).clamp(max=self.side - 1)
        rows, weights = [], []
        for r, wr in ((lo[:, 0], 1 - frac[:, 0]), (hi[:, 0], frac[:, 0])):
            for c, wc in ((lo[:, 1], 1 - frac[:, 1]), (hi[:, 1], frac[:, 1])):
                rows.append(r * self.side + c)
                weights.append(wr * wc)
        return torch.stack(rows), torch.stack(weights)

    def _position_embeddings(self, plan: _Plan) -> torch.Tensor:
        """[N, hidden] fp32: the four table corners of each patch, weighted (the plan's)."""
        table = self.pos_embed.weight.float()
        out = table[plan.table_rows[0]] * plan.table_weights[0, :, None]
        for k in range(1, 4):
            out = out + table[plan.table_rows[k]] * plan.table_weights[k, :, None]
        return out

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy tensors named relative to the tower (`blocks.0.norm1.weight`)."""
        return load_exact(self, weights, "Qwen3-VL")
